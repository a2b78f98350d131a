"""`EngineClient`: what a front end (the OpenAI server, its dashboard, `treadle serve`)
needs of an engine, stated once.

Owns the interface, nothing else: one engine in this process (engine/async_engine.py
`AsyncEngine`, and `PDEngine`, a subclass), or N engine replicas on Ray Serve behind
treadle's router (integrations/ray_serve/client.py `ServeEngineClient`) implement it, and
the server is written against it alone. tests/unit/test_engine_client.py checks each
implementation against it, member by member, signatures included. The two errors a
request can end with belong to the interface too. Importing this module imports neither
the server's dependencies (FastAPI, uvicorn) nor torch nor Ray: the types it names are
only read by type checkers. It implements nothing and must not grow engine logic.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from treadle.config import EngineConfig
    from treadle.engine.limits import EngineLimits
    from treadle.engine.output_processor import RequestOutput
    from treadle.engine.timeline import StepRecorder
    from treadle.lora import AdapterSpec, LoRARequest
    from treadle.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class EngineFailedError(EngineDeadError):
    """The engine loop failed while the request was in flight (an internal error)."""


class MetricsText(Protocol):
    """An engine's metrics as /metrics serves them."""

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every metric (in a thread: it may wait on
        replicas)."""


@runtime_checkable
class EngineClient(Protocol):
    """An engine as the server uses it: requests in, streams of outputs out, its limits,
    tokenizer and health, adapters, tenant weights and step recording."""

    # ----- what it serves ----------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (the server reads its scheduler options)."""

    @property
    def limits(self) -> EngineLimits:
        """What a request must fit: vocabulary, context length, the whole KV cache."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (transformers), or None when the checkpoint has none."""

    @property
    def eos_token_id(self) -> int | None:
        """The model's end-of-sequence token id (grammars end on it)."""

    @property
    def model_name(self) -> str:
        """The base model's name in the API (`model` of requests and /v1/models)."""

    @property
    def model_dir(self) -> str | Path:
        """The checkpoint folder the engine loaded (/v1/models' `root`)."""

    @property
    def supports_structured_outputs(self) -> bool:
        """Whether the engine applies grammar masks (it has the model's tokenizer files)."""

    def step_thread_cpus(self) -> set[int] | None:
        """The CPU the thread that steps the engine last ran on, in this process (grammar
        compiles are held to it: server/grammars.py), or None (the engine steps in
        another process, or the platform does not say)."""

    # ----- health and lifecycle ----------------------------------------------------------

    @property
    def metrics(self) -> MetricsText:
        """The engine's metrics (an EngineMetrics for one engine: the dashboard reads it)."""

    @property
    def error(self) -> BaseException | None:
        """Why the engine died (None while it runs): the server exits soon after."""

    @property
    def is_alive(self) -> bool:
        """Whether the engine can serve a request now (/health)."""

    @property
    def stalled(self) -> str | None:
        """Why the engine makes no progress although work is queued (no step for
        stall_timeout seconds: engine/watchdog.py), or None (GET /ready)."""

    @property
    def num_in_flight(self) -> int:
        """Requests handed to `generate` and not yet finished (the shutdown drain)."""

    def start(self) -> None:
        """Start stepping (the engine is built, and weights loaded, by its constructor)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop stepping and release the workers (or replicas)."""

    # ----- requests ----------------------------------------------------------------------

    def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int = 0, tenant: str | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's up-to-date output after every step that changed it; leaving the
        iteration early aborts it. EngineDeadError when the engine cannot take it,
        EngineFailedError when the engine failed while serving it."""

    def abort(self, request_id: str) -> None:
        """End a request early (its stream ends with the abort)."""

    def abort_all(self, reason: str) -> None:
        """End every in-flight request with an error naming `reason` (shutdown)."""

    # ----- tenants and observability -----------------------------------------------------

    @property
    def tenant_weights(self) -> dict[str, float]:
        """The fair policy's tenant weights (a copy; unlisted tenants weigh 1)."""

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """Set a tenant's weight under the fair policy."""

    def record_steps(self, max_steps: int = 2048, max_finished: int = 1000) -> StepRecorder:
        """A recorder of the recent steps and request timelines (the dashboard's source);
        ValueError where the engine cannot offer one."""

    # ----- LoRA adapters -----------------------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (enable_lora)."""

    def add_lora(self, name: str, path: str) -> AdapterSpec:
        """Register an adapter under a fresh id (LoRAError when it does not fit)."""

    def check_lora(self, name: str, path: str) -> AdapterSpec:
        """Check an adapter's files against the model without registering it."""

    def remove_lora(self, name: str) -> LoRARequest | None:
        """Forget an adapter (None when there was none of that name)."""

    def get_lora(self, name: str) -> LoRARequest | None:
        """The adapter registered under `name`, or None."""

    def list_loras(self) -> list[LoRARequest]:
        """Every registered adapter."""
