"""The parts of ``accum-kit bench``: what differs by engine around the one sweep (:mod:`.sweep`), and which part runs.

The sweep is the same under every engine: presets x K x arms, the arms rotated from one block of runs
to the next, repeats, paired ratios with 95 % intervals, one record per arm and block, one writer of the
files. A *part* says the rest (:class:`BenchPart`):

- its **arms** and how to switch between them: on one process (no DDP wrapper) accum-kit's loop, a plain
  PyTorch loop and the peers (:mod:`.part_single`); under DDP the modes (``sync_each_batch``, ``no_sync``,
  ``raw_ddp``, the manual all-reduce modes, the peers; :mod:`.part_ddp`), with ``--tune`` DDP's constructor
  settings (:mod:`.part_tune`); under FSDP2 / HSDP the accumulation policies, switched between windows of
  one run (:mod:`.part_fsdp2`); under DeepSpeed the ZeRO stages, one engine each (:mod:`.part_zero`); with
  ``--torch_compile`` eager and compiled (:mod:`.part_compiled`, a mode of the sweep under any DDP launch);
- the **flags** that mean nothing under its engine (refused by :class:`~accum_kit.bench.bench_config.BenchConfig`)
  and its default schedule;
- what it **reports**: its rows, columns and ideal (its ``report_<part>`` module), its tables (:mod:`.bench_tables`),
  its verdicts, its files (:mod:`.bench_files`).

The engine's part is chosen by the launch's engine name (:func:`accum_kit.engines.requested_engine_name`)
from :data:`PARTS`, and a DDP launch of one process (``accelerate_configs/cpu_single.yaml``, one GPU, or plain
``python -m accum_kit bench``) gets the one-process part; nothing here or in the sweep asks which engine runs.
"""

from __future__ import annotations

import importlib

from ..errors import UsageError
from .bench_config import ALL_MODES, DEFAULT_SCHEDULE, FSDP_SCHEDULE, MODES
from .bench_files import csv_text
from .bench_tables import format_targets

#: The part of each engine (``Engine.name``): module and class in this package, imported when asked for;
#: ``one_process``: a DDP launch of one process, where there is no DDP wrapper to compare.
PARTS = {"ddp": ("part_ddp", "DDPBench"), "fsdp2": ("part_fsdp2", "FSDP2Bench"), "deepspeed": ("part_zero", "ZeroBench"),
         "one_process": ("part_single", "SingleBench")}


def engine_part() -> "BenchPart":
    """The part of the engine the launch asks for (its accelerate config; :func:`accum_kit.engines.requested_engine_name`);
    a DDP launch of one process (:func:`accum_kit.launch.launcher_world_size`) gets the one-process part.

    Raises:
        UsageError: the launch asks for two engines.
    """
    from ..engines import requested_engine_name
    from ..launch import launcher_world_size

    engine = requested_engine_name()
    if engine == "ddp" and launcher_world_size() == 1:
        engine = "one_process"
    module, name = PARTS[engine]
    return getattr(importlib.import_module(f".{module}", __package__), name)()


def run_part(cfg) -> "BenchPart":
    """The part that runs ``cfg`` (a checked ``BenchConfig``): eager against compiled under ``--torch_compile``
    (:mod:`.part_compiled`), else the engine's part, which may hand over to a mode of its own (DDP's ``--tune``)."""
    if cfg.torch_compile:
        from .part_compiled import CompiledBench

        return CompiledBench()
    return engine_part().for_config(cfg)


class BenchPart:
    """What one part of the sweep says. Defaults are the DDP modes'; each part overrides what it does otherwise.

    Attributes:
        name: the part's name (the engine's ``Engine.name``, or ``tune`` / ``compile``).
        schema: ``bench.json``'s (or ``tune.json``'s, ``compile.json``'s) ``schema``.
        progress: the progress bar's label.
        arm_key: the run records' key naming the arm (``mode``, ``policy``, ``stage``).
        collects: keys of :meth:`summarize`'s result kept per preset for :meth:`result` rather than in the
            preset's ``info``.
        default_schedule: ``(measured steps, warm-up steps, repeats)`` unless given or ``--quick``.
        k_outer: True runs every repeat of one K before the next K (a part that builds its arms per K);
            False runs every K once per repeat.
        timings_from: the result's ``timings_from``.
        needs: the ``--num_processes`` error's problem, before ``>= 2 processes``.
        fix_suffix: what follows ``-m accum_kit bench`` in that error's fix.
        stem: the files' name before ``.json``, ``.csv`` and ``.png``.
        csv_fields: the CSV's columns, one row per ``rows`` entry (empty: no CSV).
        plot: ``plot(result) -> PNG bytes`` (None: no plot).
    """

    name = "ddp"
    #: ``--use_peft`` (LoRA adapters on the frozen preset) is measured under this part (DDP's modes, FSDP2's policies)
    measures_adapters = False
    schema = "accum_kit.bench/2"
    progress = "bench runs"
    arm_key = "mode"
    collects: tuple = ("rows",)
    default_schedule = DEFAULT_SCHEDULE
    k_outer = False
    timings_from = "process 0 (step times); peak memory: max over processes"
    needs = "the bench compares DDP modes and needs"
    fix_suffix = ""
    stem = "bench"
    csv_fields: tuple = ()
    plot = None

    # ---- the flags (BenchConfig checks them on construction, before the launch is used) ----------------
    def for_config(self, cfg) -> "BenchPart":
        """The part that runs ``cfg`` (itself unless a flag asks for a mode of its own)."""
        return self

    def hybrid(self) -> bool:
        """Whether the launch has a replicate group (HSDP): the HSDP-only flag and policy need one."""
        return False

    def default_policies(self) -> list[str]:
        """``--accumulation_policies``' default (recorded in the config even where the part has no policies)."""
        from ..engines.policies import policies_for

        return policies_for(self.hybrid())

    def default_modes(self) -> list[str]:
        """``--modes``' default: here the DDP modes :data:`~accum_kit.bench.bench_config.MODES`."""
        return list(MODES)

    def mode_choices(self) -> tuple:
        """What ``--modes`` may name: here :data:`~accum_kit.bench.bench_config.ALL_MODES`."""
        return ALL_MODES

    def check_loop_flags(self, cfg) -> None:
        """Refuse the one-process bench's loop flags (``--mixed_precision``, ``--max_grad_norm``, ``--optim``):
        the multi-process arms (raw DDP, the hand-written all-reduce...) run AdamW in float32 without clipping.

        Raises:
            UsageError: naming the first one given.
        """
        self.refuse([("--mixed_precision", cfg.mixed_precision is not None), ("--max_grad_norm", cfg.max_grad_norm != 0),
                     ("--optim", cfg.optim != "adamw_torch")], "applies to the one-process bench only (the arms "
                    "compared across processes run AdamW in float32 without clipping)",
                    "drop {flag}, or run the bench on one process (accelerate_configs/cpu_single.yaml)")

    def check_flags(self, cfg, policies_given: bool) -> None:
        """Refuse the flags that mean nothing under this part's engine (here: the policies and the stages).

        Raises:
            UsageError: naming the flag and the launch it needs.
        """
        self.refuse([("--accumulation_policies", policies_given)], "compares FSDP2 policies, and this launch is not "
                    "sharded", "launch with accelerate_configs/cpu_fsdp.yaml, or pass --modes for the DDP loops")
        self.refuse_stages(cfg)

    @staticmethod
    def refuse(flags: list[tuple[str, bool]], problem: str, fix: str) -> None:
        """Refuse the first given flag of ``flags`` (``(flag, given)`` pairs): ``flag`` + ``problem``, ``fix``.

        Raises:
            UsageError: naming that flag.
        """
        for flag, given in flags:
            if given:
                raise UsageError(flag, problem, fix.format(flag=flag))

    @staticmethod
    def ddp_only_flags(cfg) -> list[tuple[str, bool]]:
        """``(flag, given)`` for every flag that only means something under DDP: ``--tune``, ``--comm_hook`` and
        DDP's constructor settings."""
        from ..engines.ddp import flag_of

        return [("--tune", cfg.tune), ("--comm_hook", cfg.comm_hook != "none"),
                *((flag_of(name), True) for name in cfg.ddp_kwargs())]

    def refuse_stages(self, cfg) -> None:
        """``--zero_stages`` outside a DeepSpeed launch.

        Raises:
            UsageError: ``--zero_stages`` given.
        """
        self.refuse([("--zero_stages", cfg.zero_stages is not None)], "compares DeepSpeed ZeRO stages, and this "
                    "launch is not DeepSpeed", "launch with accelerate_configs/cpu_deepspeed.yaml")

    # ---- the run ------------------------------------------------------------------------------
    def config_file(self) -> tuple[str, int]:
        """The accelerate config (in ``accelerate_configs/``) that repeats this run, and the processes it starts."""
        return "cpu_ddp.yaml", 2

    def check_launch(self, cfg) -> None:
        """Refuse a launch this part cannot run, before anything is built.

        Raises:
            UsageError: ``--num_processes``: fewer than 2 processes.
        """
        from ..launch import launcher_world_size

        launched = launcher_world_size()
        if launched < 2:
            raise UsageError("--num_processes", f"{self.needs} >= 2 processes (launched: {launched})",
                             f"run it under accelerate launch --config_file accelerate_configs/{self.config_file()[0]} "
                             f"-m accum_kit bench{self.fix_suffix}")

    def build_accelerator(self, cfg):
        """The run's Accelerator (:func:`accum_kit.build_accelerator`) with the bench's DDP settings."""
        from ..launch import build_accelerator

        return build_accelerator(None, ddp_kwargs=cfg.ddp_kwargs(), **cfg.checkpointing())

    def arms(self, cfg) -> list:
        """The arms compared, in their first order."""
        return list(cfg.modes)

    def twin_arms(self, cfg) -> list:
        """The arms that ``--gradient_checkpointing_ab`` gives a checkpointed twin (:mod:`.checkpointing_ab`);
        here none."""
        return []

    def shift(self, repeat: int, k_index: int, block: int) -> int:
        """By how many places the arms' order is rotated in a block (``block``: its index in run order):
        here one more every block, so consecutive blocks start with different arms."""
        return block

    def session(self, cfg, preset: str, accelerator):
        """The runs of one preset: an object with ``warm_up()``, ``run_block(K, repeat, order) -> records``
        (one per arm, in ``order``) and ``close() -> info`` (see :func:`accum_kit.bench.sweep.sweep_preset`)."""
        raise NotImplementedError

    def arm_label(self, record: dict) -> str:
        """How the progress bar names a record's arm."""
        return str(record[self.arm_key])

    # ---- the report ---------------------------------------------------------------------------
    def summarize(self, preset: str, info: dict, runs: list[dict], cfg, world: int) -> dict:
        """The preset's figures: :attr:`collects` keys (``rows``...) and keys added to its ``info``."""
        raise NotImplementedError

    def format_preset(self, preset: str, info: dict, collected: dict, cfg) -> str:
        """The text printed when a preset is done."""
        raise NotImplementedError

    def result(self, cfg, presets: dict, collected: dict, runs: list[dict], world: int) -> tuple[dict, str | None]:
        """``(the result's keys after its head, the verdicts' text or None)``; ``collected``: per preset, the
        :attr:`collects` keys of :meth:`summarize`."""
        rows = [r for c in collected.values() for r in c["rows"]]
        return {"presets": presets, "rows": rows, "runs": runs}, None

    def files(self, result: dict) -> dict:
        """The files written (name -> contents, see :func:`accum_kit.bench.bench_files.write_files`): the result
        as JSON, its rows as CSV (:attr:`csv_fields`), the plot (:attr:`plot`)."""
        files = {f"{self.stem}.json": result}
        if self.csv_fields:
            files[f"{self.stem}.csv"] = csv_text(result["rows"], self.csv_fields)
        if self.plot is not None:
            files[f"{self.stem}.png"] = self.plot(result)
        return files


class WindowedPart(BenchPart):
    """A part whose arms take turns window by window inside its runs (FSDP2's policies, the ZeRO stages).

    Its schedule counts cycles of one window per arm (``FSDP_SCHEDULE``), each K's leading arm changes every
    repeat, its rows come from :attr:`figures` and are printed by :attr:`table`, and its verdicts are
    :attr:`targets`, one line each.

    Attributes:
        figures: ``figures(preset, info, runs, cfg, world) -> {"rows": [...], more info keys}``.
        table: ``table(preset, info, rows) -> str``.
        targets: ``targets(rows, presets) -> [{"preset", "target", "status", "detail"}]``.
    """

    default_schedule = FSDP_SCHEDULE
    timings_from = "process 0 (step times); memory: max over processes"
    figures = table = targets = None

    def shift(self, repeat: int, k_index: int, block: int) -> int:
        """Each K's leading arm changes every repeat."""
        return repeat + k_index

    def summarize(self, preset, info, runs, cfg, world) -> dict:
        return self.figures(preset, info, runs, cfg, world)

    def format_preset(self, preset, info, collected, cfg) -> str:
        return self.table(preset, info, collected["rows"])

    def result(self, cfg, presets, collected, runs, world):
        body, _ = super().result(cfg, presets, collected, runs, world)
        targets = self.targets(body["rows"], presets)
        return {"presets": presets, "rows": body["rows"], "targets": targets, "runs": runs}, format_targets(targets)
