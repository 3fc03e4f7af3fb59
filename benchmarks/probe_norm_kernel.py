"""Probe: the one-pass norm kernel's launch configuration, swept on one CUDA GPU against the bytes it must read.

``dora_norm_triton._row_norm_partial_kernel`` reads ``W`` once; at small ranks its tensor-core work is a few µs, so
it is bound by memory and its floor is ``bytes(W) / bandwidth``. ``bench_norm.py`` measured it at about 40 % of the
H200's bandwidth for the Llama-3.1-8B projections (and the split path's ``W·Aᵀ`` GEMM at about half). This probe
times the kernel under every configuration in a grid (rows and columns per tile, warps, pipeline stages, programs
per SM through the column split) per projection shape, rank and adapter dtype, with ``W`` read cold (the graph walks
enough copies of it to exceed the L2 cache), and records the current rule's time beside the fastest configuration's.

    PYTHONPATH=<ours> python benchmarks/probe_norm_kernel.py --out $OUT/probe_norm_kernel.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from pathlib import Path

import torch
from bench_norm import ADAPTER_DTYPES, LAYER, gpu_us, reference, tensors


# the fastest configuration per projection of the --variants run (results/profile/probe_norm_kernel_variants.json)
BEST = {"q": (64, 128, 4, 3, 4), "gate": (64, 128, 4, 3, 2), "down": (128, 64, 4, 3, 4)}
FORMS = ("acc2d=0 dot_init=0", "acc2d=1 dot_init=0", "acc2d=0 dot_init=1", "acc2d=1 dot_init=1")
COLD_BYTES = 256 << 20  # copies of W per graph: at least this many bytes, several times the L2 cache


def configs(nt, d_out: int, d_in: int, rank: int, sm: int):
    """(label, _Config) over the grid, the current rule's first."""
    yield "rule", nt._launch_config(d_out, d_in, nt._next_pow2(rank), sm)
    block_r = min(64, max(16, nt._next_pow2(rank)))
    for bm, bk, warps, stages, per_sm in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (2, 3, 4), (2, 4, 8)):
        if bm * bk > 4096 * warps or (rank > block_r and warps == 4):
            continue  # the fp32 tile alone would take over 128 registers a thread; the rank loop spills with 4
        policy = nt._Policy(bm, bk, warps, stages, programs_per_sm=per_sm, min_tiles_per_split=1)
        yield f"m{bm} k{bk} w{warps} s{stages} p{per_sm}", nt._policy_config(policy, d_out, d_in, block_r, sm)


def probe(args) -> dict:
    from peft.tuners.lora import dora_norm_triton as nt

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [s for s in LAYER if s[0] in args.projs.split(",")]
    rows = []
    for adapter_name, rank, (name, d_out, d_in) in itertools.product(
        args.adapters.split(","), [int(r) for r in args.ranks.split(",")], shapes
    ):
        w, a, b = tensors(d_out, d_in, rank, ADAPTER_DTYPES[adapter_name], "cuda")
        ref = reference(w, a, b, 1.0)
        copies = [w] + [w.clone() for _ in range(max(1, -(-COLD_BYTES // (w.numel() * 2))) - 1)]
        floor_us = w.numel() * w.element_size() / (args.bandwidth_tbs * 1e6)
        timed = []
        for label, cfg in configs(nt, d_out, d_in, rank, sm):
            if args.configs and label != "rule" and label not in args.configs.split(";"):
                continue
            try:
                out = nt._row_norm_triton(w, a, b, 1.0, cfg)
                err = ((out.double() - ref).abs() / ref).max().item()
                us = gpu_us(lambda: [nt._row_norm_triton(c, a, b, 1.0, cfg) for c in copies], args.reps, args.rounds)
            except Exception as exc:  # a configuration the compiler rejects (shared memory, registers)
                timed.append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            timed.append({"config": label, "us": round(us / len(copies), 2), "max_rel_err": float(f"{err:.3g}")})
        ok = sorted((t for t in timed if "us" in t), key=lambda t: t["us"])
        rule = next(t for t in timed if t["config"] == "rule")
        row = {"adapter": adapter_name, "rank": rank, "proj": name, "d_out": d_out, "d_in": d_in,
               "floor_us": round(floor_us, 2), "rule": rule, "best": ok[:5], "all": timed}  # fmt: skip
        rows.append(row)
        if args.out:  # each combination as it finishes: a run cut short keeps what it timed
            Path(args.out).write_text(json.dumps({"kind": "probe_norm_kernel", "rows": rows}, indent=1))
        print(f"{adapter_name} r={rank:<4} {name:<5} floor {floor_us:6.1f} µs  rule {rule.get('us')}  "
              f"best {ok[0]['us']} ({ok[0]['config']})", flush=True)  # fmt: skip
    return {"rows": rows}


def variant_kernel():
    """A copy of the partial kernel (native half adapters, B resident) with two changes under test: ``ACC2D`` adds the
    squares into a [BLOCK_M, BLOCK_K] tile and reduces it once at the end instead of once per tile; ``DOT_INIT``
    starts the tile's product from ``W`` (``tl.dot(b, a, w)``, scale 1) instead of adding ``W`` to it."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(w_ptr, a_ptr, b_ptr, partial_ptr, n_rows, n_cols, rank, n_row_blocks, cols_per_split, scale,
               stride_wm, stride_ak, stride_bm,
               ACC2D: tl.constexpr, DOT_INIT: tl.constexpr, WHERE: tl.constexpr, SCALED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        split = pid // n_row_blocks
        rows = (pid % n_row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        col_start = split * cols_per_split
        col_end = tl.minimum(col_start + cols_per_split, n_cols)
        r_offs = tl.arange(0, BLOCK_R)
        b = tl.load(b_ptr + rows[:, None] * stride_bm + r_offs[None, :],
                    mask=(rows[:, None] < n_rows) & (r_offs[None, :] < rank), other=0.0)  # fmt: skip
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for c in range(col_start, col_end, BLOCK_K):
            cols = c + tl.arange(0, BLOCK_K)
            col_mask = cols < n_cols
            a = tl.load(a_ptr + r_offs[:, None] * stride_ak + cols[None, :],
                        mask=(r_offs[:, None] < rank) & col_mask[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + rows[:, None] * stride_wm + cols[None, :],
                        mask=(rows[:, None] < n_rows) & col_mask[None, :], other=0.0)  # fmt: skip
            if DOT_INIT:
                v = tl.dot(b, a, w.to(tl.float32))
            elif SCALED:
                v = w.to(tl.float32) + scale * tl.dot(b, a)
            else:
                v = w.to(tl.float32) + tl.dot(b, a)
            if WHERE:
                v = tl.where(col_mask[None, :], v, 0.0)
            if ACC2D:
                acc2 += v * v
            else:
                acc += tl.sum(v * v, axis=1)
        if ACC2D:
            acc = tl.sum(acc2, axis=1)
        tl.store(partial_ptr + split * n_rows + rows, acc, mask=rows < n_rows)

    return kernel


def probe_variants(args) -> list:
    """The variant kernel's four forms over a smaller grid, bf16 adapters, W read cold; µs per call of the partial
    kernel alone (the finish pass of a few µs is left out, so the figures are a lower bound for a full norm)."""
    from peft.tuners.lora import dora_norm_triton as nt

    kernel, sm, rows = variant_kernel(), torch.cuda.get_device_properties(0).multi_processor_count, []
    for rank, (name, d_out, d_in) in itertools.product(
        [int(r) for r in args.ranks.split(",")], [s for s in LAYER if s[0] in args.projs.split(",")]
    ):
        w, a, b = tensors(d_out, d_in, rank, torch.bfloat16, "cuda")
        copies = [w] + [w.clone() for _ in range(max(1, -(-COLD_BYTES // (w.numel() * 2))) - 1)]
        block_r = max(16, nt._next_pow2(rank))
        timed = []
        grid = itertools.product((False, True), (False, True), (64, 128), (64, 128), (4, 8), (3, 4), (2, 4), [0])
        if args.toggles:  # the production kernel's features one at a time, at the forms' best configuration
            bm, bk, warps, stages, per_sm = BEST[name]
            grid = [(False, False, bm, bk, warps, stages, per_sm, t) for t in range(8)]
        for acc2d, dot_init, bm, bk, warps, stages, per_sm, toggles in grid:
            policy = nt._Policy(bm, bk, warps, stages, programs_per_sm=per_sm, min_tiles_per_split=1)
            cols = nt._policy_config(policy, d_out, d_in, block_r, sm).cols_per_split
            row_blocks, splits = nt._cdiv(d_out, bm), nt._cdiv(d_in, cols)
            part = torch.empty(splits, d_out, device="cuda")

            def run(c, bm=bm, bk=bk, warps=warps, stages=stages, cols=cols, acc2d=acc2d, dot_init=dot_init,
                    part=part, row_blocks=row_blocks, splits=splits, toggles=toggles):  # fmt: skip
                kernel[(row_blocks * splits,)](
                    c, a, b, part, d_out, d_in, rank, row_blocks, cols, 1.0, c.stride(0), a.stride(0), b.stride(0),
                    ACC2D=acc2d, DOT_INIT=dot_init, WHERE=bool(toggles & 1), SCALED=bool(toggles & 2),
                    BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=block_r, num_warps=warps, num_stages=stages,
                    enable_fp_fusion=not toggles & 4,
                )  # fmt: skip

            label = f"acc2d={int(acc2d)} dot_init={int(dot_init)} m{bm} k{bk} w{warps} s{stages} p{per_sm}"
            if args.toggles:
                label += f" where={toggles & 1} scaled={toggles >> 1 & 1} no_fp_fusion={toggles >> 2}"
            try:
                us = gpu_us(lambda: [run(c) for c in copies], args.reps, args.rounds) / len(copies)
            except Exception as exc:
                timed.append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                continue
            got = part.sum(0).sqrt().double()
            err = ((got - reference(w, a, b, 1.0)).abs() / reference(w, a, b, 1.0)).max().item()
            timed.append({"config": label, "us": round(us, 2), "max_rel_err": float(f"{err:.3g}")})
        ok = sorted((t for t in timed if "us" in t), key=lambda t: t["us"])
        best = {f: next((t for t in ok if t["config"].startswith(f)), None) for f in FORMS}
        if args.toggles:
            for t in timed:
                print("   ", t["config"], t.get("us"), flush=True)
        rows.append({"rank": rank, "proj": name, "best_by_form": best, "all": timed})
        print(f"variants r={rank} {name}: " + ", ".join(f"{k}: {v and v['us']}" for k, v in best.items()), flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="16")
    p.add_argument("--adapters", default="bf16,fp32")
    p.add_argument("--projs", default="q,k,gate,down")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bandwidth-tbs", type=float, default=4.8, help="the GPU's memory bandwidth for the floor, TB/s")
    p.add_argument("--variants", action="store_true", help="time the variant kernel's forms instead of the grid")
    p.add_argument("--configs", help="';'-separated grid labels to time (default: the whole grid)")
    p.add_argument("--toggles", action="store_true", help="with --variants: the production kernel's features in turn")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    env = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version()}
    rows = {"variants": probe_variants(args)} if args.variants else probe(args)
    config = dict(vars(args), out=Path(args.out).name)  # the file's name, not the machine's folder
    record = {"kind": "probe_norm_kernel", "env": env, "config": config, **rows}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
