"""Tiny random checkpoints of every supported family, made by transformers in the test run."""

from __future__ import annotations

import os

import pytest
import torch

from treadle.worker.cpu.cpu_isa import executable_levels

KERNEL_LEVELS = executable_levels() or ["native"]
"""The C kernels' ISA levels this CPU executes (worker/cpu/cpu_isa.py): on an AVX-512 BF16
machine the AVX-512F and AVX2 builds run too, so their tests are the twins of a machine
without BF16."""


@pytest.fixture(scope="module", params=KERNEL_LEVELS)
def kernel_level(request) -> str:
    """Each test module using it runs once per ISA level this CPU executes."""
    return request.param


@pytest.fixture(scope="module")
def level_kernels(kernel_level):
    """The C kernels built for `kernel_level` (gcc is required on test machines)."""
    from treadle.worker.cpu.native import load_kernels
    kernels = load_kernels(kernel_level)
    assert kernels is not None, "the C kernels must build on the test machine (gcc is required)"
    return kernels

FAMILIES = {
    "llama": dict(cls="LlamaConfig", extra={"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}}),
    "mistral": dict(cls="MistralConfig", extra={"sliding_window": None,
                                                "tie_word_embeddings": True}),
    "qwen2": dict(cls="Qwen2Config", extra={"rope_scaling": {"rope_type": "linear",
                                                             "factor": 2.0}}),
    "qwen3": dict(cls="Qwen3Config", extra={"head_dim": 24}),
}


def make_tiny_checkpoint(path, family: str, vocab_size: int = 512, seed: int = 0,
                         **overrides) -> str:
    import transformers

    spec = FAMILIES[family]
    settings = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        **spec["extra"])
    config = getattr(transformers, spec["cls"])(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.save_pretrained(path)
    return str(path)


def use_fresh_cache_dir(path, monkeypatch) -> str:
    """Point TREADLE_CACHE_DIR at an empty `path` for what a test converts or fetches,
    sharing the session's built C kernels (its `kernels/` is a link to them): each of
    these tests rebuilt every kernel otherwise, 15-45 s apiece."""
    from treadle.paths import cache_dir

    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(path))
    return str(path)


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def tiny_checkpoint(request, tmp_path_factory):
    """(family, checkpoint dir) for each supported family."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, make_tiny_checkpoint(path, request.param)


# ----- engines the tests start ---------------------------------------------------------

SMALL_DEFAULTS = {"TREADLE_KV_CACHE_MEMORY": "256MiB", "TREADLE_SWAP_SPACE": "128MiB"}
"""The cache sizes an engine gets when a test gives none (through the environment
variables that set the options' defaults, config.ENV_PREFIX; a `treadle serve` child
inherits them): the tiny models' tests use a sliver of what `auto` would give (a quarter
of the machine's free memory), and fixed sizes keep their block counts the same on every
machine. (The old 2 GiB + 1 GiB defaults were zeroed at each start, ~0.8 s; nothing is
written at start now.)"""


@pytest.fixture(scope="module", autouse=True)
def small_default_caches():
    with pytest.MonkeyPatch.context() as mp:
        for key, value in SMALL_DEFAULTS.items():
            if key not in os.environ:
                mp.setenv(key, value)
        yield


# ----- every engine test runs on each executor ------------------------------------------

EXECUTORS = ("uni", "mp")
ENGINE_TEST_MODULES = {"test_engine_vs_transformers", "test_llm_api", "test_policies_outputs",
                       "test_sampling", "test_server", "test_native_prefill"}
"""Modules whose engines (LLM, `treadle serve`) run once per executor: the outputs must be
identical whichever process the worker lives in."""


@pytest.fixture(scope="session", autouse=True)
def executor_backend(request):
    """The executor every engine of the test gets, through the environment variable that
    sets the option's default (config.ENV_PREFIX): LLM(...) and `treadle serve` alike."""
    import os

    name = getattr(request, "param", None)
    key = "TREADLE_DISTRIBUTED_EXECUTOR_BACKEND"
    previous = os.environ.get(key)
    if name is None:  # not an engine module: the option keeps its default
        os.environ.pop(key, None)
    else:
        os.environ[key] = name
    yield name
    if previous is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = previous


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "executors(*names): in an engine test module, run this test on these "
        "executors only (its docstring says where the others are covered)")


def pytest_generate_tests(metafunc):
    """Each test of ENGINE_TEST_MODULES once per executor, or on the executors its
    `executors` mark names: for what happens in the engine's own process (validating a
    request, configuration, the scheduler's choices), where a second executor repeats
    the same work (an mp engine spends ~3 s starting its worker process)."""
    if metafunc.module.__name__.rpartition(".")[2] in ENGINE_TEST_MODULES:
        mark = metafunc.definition.get_closest_marker("executors")
        names = mark.args if mark is not None else EXECUTORS
        assert names and set(names) <= set(EXECUTORS), names
        metafunc.parametrize("executor_backend", names, indirect=True, scope="session")
