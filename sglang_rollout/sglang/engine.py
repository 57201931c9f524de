"""SGLangEngine: SGLang's real `sglang.Engine` as a RolloutBackend running TRACE's FP4 policy.

SGLang's engine takes over the process that starts it: its shutdown kills every child process
of that process, it installs a SIGQUIT handler that kills the whole tree, and on the CPU it
needs import shims (`cpu_patches`). So each SGLangEngine runs sglang.Engine in a host process
of its own (`session.Session`, spawned), and this object forwards the RolloutBackend calls to
it over a pipe: the caller's process (a trainer) stays as it was, several engines can live and
stop in one process, and a failed engine raises in the caller instead of killing it.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import os
import traceback
import weakref

import torch

from megatron_trace.guidance import GuidanceBatch
from megatron_trace.model_config import ModelConfig, full_weight_shapes
from megatron_trace.modes import EnginePrecision
from megatron_trace.rollout import GroupRequest, RolloutOutput, SamplingParams
from megatron_trace.weight_buckets import Coverage

from .config import EngineConfig, check_layout
from .weight_group import broadcast_bucket, close_group, free_port, open_group
from .weight_payload import bucket_name, check_update, checked, packs, serialize_bucket, state_dict_buckets

__all__ = ["EngineConfig", "SGLangEngine"]
START_TIMEOUT_S = 600


class SGLangEngine:
    """A RolloutBackend over sglang.Engine in a host process (see the module docstring)."""

    def __init__(self, model_cfg: ModelConfig, engine_cfg: EngineConfig = EngineConfig()):
        check_layout(model_cfg, engine_cfg)  # before starting anything
        self.model_cfg, self.engine_cfg = model_cfg, engine_cfg
        self.weight_version = -1 if engine_cfg.checkpoint is None else 0  # a checkpoint's weights: version 0
        self._group, self._group_device = None, "cpu"  # the weight group (connect_weight_group)
        self._released = False  # release_memory gave SGLang's memory to a trainer
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._host = ctx.Process(target=_host_main, args=(child, model_cfg, engine_cfg), daemon=False,
                                 name="trace-sglang-host")
        self._host.start()
        child.close()
        # at interpreter exit multiprocessing joins its non-daemon children, and the host only
        # ends when told to: this runs first (atexit is last-in, first-out)
        ref = weakref.ref(self)
        atexit.register(lambda: (engine := ref()) is not None and engine.shutdown())
        self._call(None, timeout=START_TIMEOUT_S)  # the host reports once sglang.Engine is up

    @property
    def precision(self) -> EnginePrecision:
        return self.engine_cfg.precision

    def update_weights(self, state_dict, version: int) -> None:
        """Load a full (or partial) Megatron state dict (BF16, or FP4 QTensors for the FP4 sites)
        as `version`, in weight buckets of at most EngineConfig.weight_bucket_mb (see
        update_weights_from_buckets). ValueError for a version not newer than the current one,
        or a tensor that does not fit the model: both checked before anything is sent, so then
        the old weights stay."""
        self._check_newer(version)
        fp4 = self.precision is EnginePrecision.FP4
        check_update(self.model_cfg, state_dict, fp4)
        self._send(state_dict_buckets(self.model_cfg, state_dict, self.engine_cfg.weight_bucket_bytes, fp4),
                   version, complete=False)

    def update_weights_from_buckets(self, buckets, version: int) -> None:
        """Take `version` from weight buckets (megatron_trace.weight_buckets) as they arrive, each
        checked whole in this process and then handed to SGLang's scheduler processes as it is:
        through the weight group once `connect_weight_group` opened one (one broadcast a
        bucket), else through SGLang's update_weights_from_tensor (mapped by each scheduler
        process, no copy through the host process). The version holds once every weight has
        arrived complete, each slice exactly once.

        ValueError (naming the weight) for a version not newer than the current one, a bucket
        that does not fit, or an update that would end incomplete (its last bucket is then not
        sent). Until a bucket has gone the old weights stay; after that a failed update leaves
        the engine refusing to generate until a complete version arrives."""
        self._check_newer(version)
        self._send(buckets, version, complete=True)

    def _send(self, buckets, version: int, complete: bool) -> None:
        if self._released:  # checked here too: the weight group's broadcast would wait for a host that refused
            raise RuntimeError("the engine's memory is released (release_memory): resume_memory before sending weights")
        fp4 = self.precision is EnginePrecision.FP4
        coverage = Coverage(full_weight_shapes(self.model_cfg), packs(fp4))
        for index, (flat, last) in enumerate(checked(buckets, coverage, complete)):
            name = bucket_name(version, index)
            names = list(coverage.spans) if last else []
            if self._group is None:
                self._call(("load_bucket", serialize_bucket(name, flat, self.engine_cfg.tp_size), version, last, names))
            else:
                flat = flat.to(self._group_device)
                self._conn.send(("receive_bucket", name, flat.numel(), version, last, names))
                broadcast_bucket(flat, self._group)
                self._call(None)
        self.weight_version = version

    def _check_newer(self, version: int) -> None:
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the engine's {self.weight_version}")

    def connect_weight_group(self, *, backend: str | None = None, master_address: str = "127.0.0.1",
                             master_port: int | None = None, group_name: str = "trace-weights",
                             timeout_s: float = 300) -> None:
        """Open a weight group between this process (rank 0) and SGLang's scheduler processes
        (SGLang's init_weights_update_group; the disaggregated layout): later updates broadcast
        from here instead of passing through the host process. backend: "nccl" (default on
        CUDA: this process's current GPU sends) or "gloo" (default on the CPU)."""
        if self._group is not None:
            raise RuntimeError("connect_weight_group: this engine already has a weight group")
        cuda = self.engine_cfg.device == "cuda"
        backend = backend or ("nccl" if cuda else "gloo")
        port = master_port or free_port()
        world = 1 + self.engine_cfg.tp_size
        self._conn.send(("init_weights_update_group", master_address, port, world, group_name, backend))
        group = open_group(master_address, port, world, 0, group_name, backend, timeout_s)
        self._call(None, timeout=timeout_s)
        self._group = group
        self._group_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"

    def generate(self, requests: list[GroupRequest], sampling: SamplingParams, on_group=None) -> RolloutOutput:
        """Every request's samples, in request order, with their guidance; a bad request fails
        alone. on_group(output), if given, receives each group's output as soon as it is done
        (the host process streams groups; this object puts them together in request order)."""
        parts = {}

        def take(part: RolloutOutput) -> None:
            parts[part.samples[0].group_id if part.samples else None] = part
            if on_group is not None:
                on_group(part)
        self._call(("generate", requests, sampling), on_part=take)
        ordered = [parts[req.group_id] for req in requests if req.group_id in parts]
        return RolloutOutput([s for part in ordered for s in part.samples],
                             GuidanceBatch({k: v for part in ordered for k, v in part.guidance.groups.items()},
                                           {k: v for part in ordered for k, v in part.guidance.samples.items()}))

    def release_memory(self) -> None:
        """Free SGLang's GPU memory while a trainer on the same GPU trains (Session.release_memory;
        a no-op unless EngineConfig.release_memory)."""
        self._call(("release_memory",))
        self._released = self.engine_cfg.release_memory

    def resume_memory(self) -> None:
        """Take it back; every weight must then be sent again before generate (Session.resume_memory)."""
        self._call(("resume_memory",))
        self._released = False

    def quantization_table(self) -> dict[str, str]:
        """{HF module: "fp4" | "bf16"} of every linear and KV site as SGLang built them (the audit's view)."""
        return self._call(("quantization_table",))

    def memory(self) -> list[dict]:
        """Per TP rank, {"device", "peak", "now"}: bytes its scheduler process has held at most and
        holds now (torch's allocator on a GPU, the resident set on the CPU)."""
        return self._call(("memory",))

    def shutdown(self) -> None:
        """Stop the host process and SGLang's processes under it."""
        host = getattr(self, "_host", None)
        group, self._group = getattr(self, "_group", None), None
        if group is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                close_group(group)
        if host is None or not host.is_alive():
            return
        with contextlib.suppress(OSError, EOFError, RuntimeError, TimeoutError):  # already gone
            self._call(("shutdown",), timeout=60)
        host.join(30)
        if host.is_alive():
            host.kill()
            host.join(10)

    def __del__(self):
        self.shutdown()

    def _call(self, message, timeout: float | None = None, on_part=None):
        """Send `message` (None: only wait for the host's next reply) and return its reply's value,
        or raise the exception the host raised (same type and message). Parts the host streams
        before its reply go to on_part."""
        if message is not None:
            self._conn.send(message)
        failed = None  # an exception of on_part: raised once the host has finished the call
        while True:
            if timeout is not None and not self._conn.poll(timeout):
                raise TimeoutError(f"the SGLang engine's host process did not answer within {timeout} s")
            try:
                kind, value = self._conn.recv()
            except EOFError:
                self._host.join(5)
                raise RuntimeError(f"the SGLang engine's host process died (exit code {self._host.exitcode})") from None
            if kind != "part":
                break
            if failed is None:
                try:
                    on_part(_unpack(value))
                except Exception as e:  # noqa: BLE001 - re-raised below, after the call's last message
                    failed = e
        if failed is not None:
            raise failed
        if kind == "error":
            cls, text = value
            raise (cls if isinstance(cls, type) and issubclass(cls, Exception) else RuntimeError)(text)
        return _unpack(value)


# torchrun's variables for the caller's job: SGLang's processes form a torch.distributed world of
# their own, and a store client inherited from an elastic agent (TORCHELASTIC_USE_AGENT_STORE) hangs it
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _host_main(conn, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
    """The host process: build the Session, then answer calls until told to shut down."""
    for name in [k for k in os.environ if k in TORCHRUN_VARIABLES or k.startswith("TORCHELASTIC_")]:
        del os.environ[name]
    session = None
    try:
        from .session import Session

        session = Session(model_cfg, engine_cfg)
        conn.send(("ok", None))
        while True:
            name, *args = conn.recv()
            if name == "shutdown":
                conn.send(("ok", None))
                break
            try:
                if name == "generate":  # each group as it is done, then the end of the call
                    session.generate(*args, on_group=lambda part: conn.send(("part", _pack(part))))
                    conn.send(("ok", None))
                else:
                    conn.send(("ok", _pack(getattr(session, name)(*args))))
            except Exception as e:  # noqa: BLE001 - every failure goes back to the caller, which raises it
                conn.send(("error", (type(e), _message(e))))
    except EOFError:  # the caller is gone
        pass
    except Exception as e:  # noqa: BLE001 - a failed start is the caller's error
        conn.send(("error", (type(e), _message(e))))
    finally:
        if session is not None:
            session.shutdown()


def _pack(value) -> bytes | None:
    """A reply's value as bytes (its tensors by value: a rollout holds many small tensors, and
    sharing each through its own file descriptor would run out of them)."""
    if value is None:
        return None
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(value: bytes | None):
    return None if value is None else torch.load(io.BytesIO(value), weights_only=False)


def _message(e: Exception) -> str:
    """The exception's text; for unexpected errors with the host's traceback, so it is not lost."""
    if isinstance(e, (ValueError, KeyError, RuntimeError, TimeoutError)):
        return str(e)
    return f"{e}\n(in the SGLang engine's host process)\n{traceback.format_exc()}"
