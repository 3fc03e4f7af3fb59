"""Makes `tests/` importable as a source of helpers (`import dora_testing`) for test modules in sub-folders: pytest
puts a rootless conftest's folder on sys.path. The package under test is always the installed `peft`."""
