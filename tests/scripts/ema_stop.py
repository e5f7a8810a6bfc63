"""``handlers:`` entries for tests/test_ema_layouts.py: stop the run (resumable, with a save) at a
step, as a stop signal through the step scheduler would; kill it there; dump the average."""

from __future__ import annotations

from hookloop.engine import Events, ExitCode, Priority


class StopAt:
    def __init__(self, step: int) -> None:
        self.step = step

    def attach(self, trainer) -> None:
        def stop(engine) -> None:
            if engine.state.step == self.step:
                engine.control.request_save("test stop")
                engine.control.request_stop("test stop", ExitCode.STOPPED)

        trainer.add_event_handler(Events.STEP_START, stop, priority=Priority.DECIDE)


class KillAt:
    """SIGKILL this process when step ``step`` starts (a crash: no save, no cleanup)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def attach(self, trainer) -> None:
        import os
        import signal

        def kill(engine) -> None:
            if engine.state.step == self.step:
                os.kill(os.getpid(), signal.SIGKILL)

        trainer.add_event_handler(Events.STEP_START, kill)


class DumpAverage:
    """At TRAIN_END each rank writes the moving average it holds (whole tensors) and the last
    ``val_loss_ema`` to ``<run_dir>/ema_rank<R>.pt``."""

    def __init__(self, run_dir) -> None:
        self.run_dir = run_dir

    def attach(self, trainer) -> None:
        trainer.add_event_handler(Events.TRAIN_END, self.dump)

    def dump(self, trainer) -> None:
        import torch
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        ema = trainer.get_handler("ema")
        average = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in ema.average.items()
        }
        metrics = {k: float(v) for k, v in trainer.state.metrics.items() if k.startswith("val_")}
        torch.save({"average": average, "metrics": metrics}, f"{self.run_dir}/ema_rank{rank}.pt")
