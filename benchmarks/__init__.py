"""Micro-benchmarks, peer runners and configurations that stand beside the engine: run as
scripts (`python benchmarks/NAME.py ...`, this folder on sys.path, so a script imports
its neighbours by name) and, for the tests, importable as `benchmarks.NAME` from the
repository root (pyproject.toml puts it on pytest's path). Unlike treadle/bench, these may
reach into the engine's internals (kernels, the sampler, step messages); they are not
installed with the package."""
