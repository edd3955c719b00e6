"""The gradient probe: optimizer-step hooks that dump msprobe-layout gradient statistics.

``step`` counts ``optimizer.step()`` calls (0-based) of optimizers that own at least one
monitored parameter, which is msprobe's definition restricted to the model being watched. The
hook runs on the training thread, computes statistics without host synchronisation and hands the
rest to :class:`DumpWriter`. Nothing raises into training: failures are counted and logged once.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from commcheck.gradprobe import layout
from commcheck.gradprobe.buffers import SlotPool
from commcheck.gradprobe.config import DEFAULT_BOUNDS, GradProbeConfig, build_config, load_config
from commcheck.gradprobe.errors import GradProbeConfigError
from commcheck.gradprobe.events import ProbeEvent, Sink
from commcheck.gradprobe.stats import StatEngine, StatPlan, make_plan
from commcheck.gradprobe.writer import DumpWriter, StepJob

log = logging.getLogger("commcheck.gradprobe")


@dataclass
class ProbeCounters:
    steps_seen: int = 0
    steps_dumped: int = 0
    directions_dropped: int = 0
    hook_errors: int = 0
    sink_errors: int = 0


def current_rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def gradient_of(param: torch.Tensor) -> torch.Tensor | None:
    """Megatron keeps the reduced fp32 gradient in ``main_grad``; prefer it like msprobe does."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


class GradProbe:
    """Dump per-parameter gradient statistics at every selected optimizer step."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        level: str = "L1",
        dump_path: str = "./dump_path",
        rank: list[int | str] | None = None,
        step: list[int | str] | None = None,
        param_list: list[str] | None = None,
        bounds: list[float] | tuple[float, ...] = DEFAULT_BOUNDS,
        packed_direction: bool = False,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        sink: Sink | None = None,
        max_pending_mib: int = 512,
        block_when_full: bool = False,
        native_kernel: bool = True,
        config: GradProbeConfig | None = None,
        live_check: bool = True,
        replica_group: Any = None,
    ) -> None:
        self.config = config or build_config(
            dump_path=dump_path,
            level=level,
            rank=rank,
            step=step,
            param_list=param_list,
            bounds=bounds,
            packed_direction=packed_direction,
            max_pending_mib=max_pending_mib,
            block_when_full=block_when_full,
            native_kernel=native_kernel,
        )
        self.counters = ProbeCounters()
        self.rank = 0
        self._sink = sink
        self._live_check = live_check
        self._replica_group = replica_group
        self._names: dict[int, str] = {}
        self._order: list[tuple[str, torch.Tensor]] = []
        self._selections: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], list]] = (
            weakref.WeakKeyDictionary()
        )
        self._plans: dict[tuple, tuple[StatPlan, SlotPool | None]] = {}
        self._handles: list[Any] = []
        self._engine = StatEngine(native=self.config.native_kernel)
        self._writer: DumpWriter | None = None
        self._dumping = False
        self._step = -1
        self._current: tuple[int, tuple[str, ...], tuple[torch.Tensor, ...]] | None = None
        self._logged: set[str] = set()
        if model is not None:
            self.monitor(model, optimizer)

    @property
    def step(self) -> int:
        """The last optimizer step seen (0-based); -1 before the first one."""
        return self._step

    def monitor(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        """Start watching ``model``; hooks every optimizer, or only ``optimizer`` if given."""
        if self._handles:
            raise RuntimeError("GradProbe.monitor() was already called; call stop() first")
        named = list(model.named_parameters())
        wanted = set(self.config.param_list)
        unknown = [n for n in self.config.param_list if n not in dict(named)]
        if unknown:
            raise GradProbeConfigError(
                "param_list", unknown[0], f"is not a parameter of {type(model).__name__}"
            )
        self._order = [(n, p) for n, p in named if not wanted or n in wanted]
        self._names = {id(p): n for n, p in self._order}
        self.rank = current_rank()
        self._dumping = self.rank in self.config.rank
        if self._sink is None and self._live_check:
            from .live import LiveCheck  # needs commcheck.patch() and a process group

            self._sink = LiveCheck.for_active_session(self._replica_group)
        if not self._dumping and self._sink is None:
            return
        if self._dumping:
            rank_path = layout.rank_dir(self.config.dump_path, self.rank)
            os.makedirs(rank_path, exist_ok=True)
            self._writer = DumpWriter(self.config.block_when_full, rank_path)
        self._register(optimizer)

    def _register(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._pre_hook))
            if self._sink is not None:
                self._handles.append(optimizer.register_step_post_hook(self._post_hook))
            return
        self._handles.append(register_optimizer_step_pre_hook(self._pre_hook))
        if self._sink is not None:
            self._handles.append(register_optimizer_step_post_hook(self._post_hook))

    def flush(self) -> None:
        """Wait until every step dumped so far is on disk; the hooks stay active."""
        if self._writer is not None:
            self._writer.flush()

    def stop(self) -> None:
        """Remove the hooks and wait until every queued step is on disk. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._writer is not None:
            was_running = self._writer.running
            self._writer.stop()
            if was_running:
                self._report_drops()
        self._engine.close()

    def __enter__(self) -> GradProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            selection = self._selection(optimizer)
            if not selection:
                return
            self._step += 1
            self.counters.steps_seen += 1
            names, params, grads = [], [], []
            for name, param in selection:
                grad = gradient_of(param)
                if grad is None:
                    continue
                names.append(name)
                params.append(param)
                grads.append(grad.detach())
            self._current = (self._step, tuple(names), tuple(params))
            self._emit("grad", self._step, names, grads)
            if self._dumping and self._step in self.config.step and grads:
                self._dump(self._step, names, grads)
        except Exception as exc:
            self.counters.hook_errors += 1
            self._log_once("hook", "gradprobe: hook failed (further errors counted): %s", exc)

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        current, self._current = self._current, None
        if current is None or not current[1]:
            return
        step, names, params = current
        self._emit("param", step, list(names), [p.detach() for p in params])

    def _emit(self, phase: str, step: int, names: list[str], tensors: list[torch.Tensor]) -> None:
        if self._sink is None:
            return
        try:
            self._sink(ProbeEvent(phase, step, self.rank, tuple(names), tuple(tensors)))
        except Exception as exc:
            self.counters.sink_errors += 1
            self._log_once("sink", "gradprobe: sink failed (further errors counted): %s", exc)

    def _selection(self, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        """Monitored parameters this optimizer owns, in ``named_parameters()`` order."""
        signature = tuple(len(g["params"]) for g in optimizer.param_groups)
        cached = self._selections.get(optimizer)
        if cached is not None and cached[0] == signature:
            return cached[1]
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        selection = [(n, p) for n, p in self._order if id(p) in owned]
        self._selections[optimizer] = (signature, selection)
        return selection

    def _dump(self, step: int, names: list[str], grads: list[torch.Tensor]) -> None:
        plan, pool = self._plan(names, grads)
        slot = pool.acquire(self.config.block_when_full) if pool is not None else None
        if pool is not None and slot is None:
            self.counters.directions_dropped += 1
            self._log_once(
                "drop", "gradprobe: writer behind; step %d written without direction files", step
            )
        stats = self._engine.compute(plan, grads, slot.tensors if slot is not None else None)
        job = StepJob(
            rank_path=layout.rank_dir(self.config.dump_path, self.rank),
            step=step,
            level=self.config.level,
            bounds=self.config.bounds,
            stats=stats,
            slot=slot,
            packed=self.config.packed_direction,
            release=pool.release if pool is not None else None,
        )
        assert self._writer is not None
        if self._writer.submit(job):
            self.counters.steps_dumped += 1

    def _plan(
        self, names: list[str], grads: list[torch.Tensor]
    ) -> tuple[StatPlan, SlotPool | None]:
        key = tuple(
            (n, tuple(g.shape), g.dtype, g.device) for n, g in zip(names, grads, strict=True)
        )
        found = self._plans.get(key)
        if found is None:
            plan = make_plan(names, grads, self.config.bounds, self.config.level)
            pool = None
            if self.config.has_direction:
                pool = SlotPool(plan.shapes, grads[0].device, self.config.max_pending_mib << 20)
            found = self._plans[key] = (plan, pool)
        return found

    def _report_drops(self) -> None:
        assert self._writer is not None
        wc = self._writer.counters
        dropped = self.counters.directions_dropped + wc.steps_dropped
        if dropped or wc.errors or self.counters.hook_errors:
            log.warning(
                "gradprobe: %d steps written, %d dropped, %d without directions, "
                "%d write errors, %d hook errors",
                wc.steps_written,
                wc.steps_dropped,
                self.counters.directions_dropped,
                wc.errors,
                self.counters.hook_errors,
            )

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.error(message, *args)

    @property
    def writer_counters(self):
        return self._writer.counters if self._writer is not None else None


class PrecisionDebugger:
    """msprobe's entry point: ``PrecisionDebugger("config.json").monitor(model)``."""

    def __init__(self, config_path: str | os.PathLike[str], *, sink: Sink | None = None) -> None:
        self.config = load_config(config_path)
        self._sink = sink
        self.probe: GradProbe | None = None

    def monitor(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> GradProbe:
        if self.probe is not None:
            self.probe.stop()
        self.probe = GradProbe(config=self.config, sink=self._sink)
        self.probe.monitor(model, optimizer)
        return self.probe

    def stop(self) -> None:
        if self.probe is not None:
            self.probe.stop()
