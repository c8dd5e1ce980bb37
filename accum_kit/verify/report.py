"""What ``accum-kit verify`` reports: per-window facts, one row per normalisation, the text and JSON forms."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tabulate import tabulate

from .batchnorm import finding_lines

#: ``--loss_normalization`` value -> the row that decides ``passed`` and the exit code.
SELECTABLE = {"tokens": "tokens", "mean": "mean-of-means"}


#: What averages the gradients over processes, by the engine's name (:attr:`accum_kit.engines.base.Engine.name`).
REDUCERS = {"ddp": "DDP", "fsdp2": "FSDP2's reduce-scatter", "deepspeed": "DeepSpeed's ZeRO reduction"}

#: Fields that word the text report and stay out of :meth:`VerifyReport.to_dict` (the JSON keeps its keys).
_TEXT_ONLY = ("engine", "casts_model")

#: Per-window figures of the ``trainer`` row, copied when present (see :func:`accum_kit.verify.trainer.trainer_summary`).
_EXTRA_WINDOW_KEYS = ("cosine", "norm_ratio", "factor", "target_tokens", "labels_counted_before_shift",
                      "predicted_if_unshifted")


@dataclass
class WindowInfo:
    """One verified accumulation window.

    Attributes:
        index: 1-based window number.
        partial: fewer than K micro-batches per process.
        micro_batches_per_process: micro-batches each process ran in it.
        examples: examples over all processes.
        target_tokens: items over all processes: target tokens (labels != -100
            after the shift) on verify's token data, else the sum of ``loss_fn``'s ``num_items``.
        oracle_grad_norm: L2 norm of the big-batch item-mean (token-mean) gradient (float64).
        oracle_sum_grad_norm: L2 norm of the big-batch summed-loss gradient.
        input_ids: the examples' token ids as run (labels are the same ids);
            lets anyone recompute the oracle. Empty for a user's dataset.
        indices: the examples' positions in the workload (a user's dataset:
            its first examples, in order), rank order then micro-batch order.
    """

    index: int
    partial: bool
    micro_batches_per_process: int
    examples: int
    target_tokens: int
    oracle_grad_norm: float
    oracle_sum_grad_norm: float
    input_ids: list = field(default_factory=list, repr=False)
    indices: list = field(default_factory=list, repr=False)


@dataclass
class Row:
    """One normalisation compared with the oracle; errors are the worst over windows.

    Attributes:
        name: ``tokens``, ``mean-of-means``, ``sum``, ``sum (DataParallel)``, ``trainer``, or under a tp / cp
            mesh ``tokens counted over every process`` / ``tokens of the local cp slice only``.
        computed_by: how our gradient was produced.
        compared_with: which oracle gradient (``big-batch token mean`` or ``big-batch sum``).
        max_abs_error: max |g - o| over all elements and windows (gradient units).
        rel_error: max over windows of ||g - o|| / ||o||.
        tolerance_used: max |g - o| / (atol + rtol |o|); <= 1 is within tolerance.
        rank_spread: max relative difference of the gradient norm between ranks
            (0 when all processes hold the same gradient, as DDP guarantees).
        The error fields are None for a skipped row.
        passed: within tolerance in every window and ranks agree.
        windows: per-window ``max_abs_error``, ``rel_error``, ``tolerance_used``, ``grad_norm``.
        skipped: why the row was not measured (None when it was).
        informational: the row never decides ``passed`` (the ``trainer`` row, the tp / cp miscount rows);
            the table shows ``info`` instead of PASS / FAIL.
        summary: the ``trainer`` row's conclusion (``factor`` = <g, o> / <o, o>
            over all windows, worst ``cosine``, ``cause``; see
            :func:`accum_kit.verify.trainer.trainer_summary`); a miscount row's ``factor`` and ``reproduces``
            (the public bug, :data:`accum_kit.engines.model_parallel.MISCOUNT_BUGS`); else None.
    """

    name: str
    computed_by: str
    compared_with: str
    max_abs_error: float | None = None
    rel_error: float | None = None
    tolerance_used: float | None = None
    rank_spread: float | None = None
    passed: bool | None = None
    windows: list = field(default_factory=list)
    skipped: str | None = None
    informational: bool = False
    summary: dict | None = None

    def add_window(self, index: int, comparison: dict) -> None:
        """Append window ``index`` (1-based) from a :func:`~accum_kit.verify.compare.compare_gradients` result."""
        self.windows.append({"window": index, "max_abs_error": comparison["max_abs_error"],
                             "rel_error": comparison["rel_error"], "tolerance_used": comparison["tolerance_used"],
                             "grad_norm": comparison["got_norm"],
                             **{k: comparison[k] for k in _EXTRA_WINDOW_KEYS if k in comparison}})

    def conclude(self, rtol: float | None = None) -> None:
        """Set the worst-over-windows errors and ``passed`` (ranks must agree within ``rtol`` when given)."""
        self.max_abs_error = max(x["max_abs_error"] for x in self.windows)
        self.rel_error = max(x["rel_error"] for x in self.windows)
        self.tolerance_used = max(x["tolerance_used"] for x in self.windows)
        self.passed = self.tolerance_used <= 1.0 and (rtol is None or self.rank_spread <= rtol)


@dataclass
class VerifyReport:
    """Everything ``accum-kit verify`` prints and writes; see :mod:`accum_kit.verify` for definitions."""

    world_size: int
    distributed_type: str
    gradient_accumulation_steps: int
    per_device_train_batch_size: int
    seed: int
    model: dict
    partial_window: bool
    windows: list
    rows: list
    rtol: float
    atol: float
    selected: str  # --loss_normalization value: "tokens" or "mean"
    ddp_sum_ratio: float | None  # None: no sum row (DeepSpeed)
    ddp_sum_residual: float | None
    dataparallel_sum_ratio: float | None = None
    oracle: dict = field(default_factory=dict)
    seconds: float = 0.0
    mixed_precision: str = "no"  # the Accelerator's --mixed_precision
    normwise: bool = False  # tolerance: normwise rel_error <= rtol (autocast) instead of elementwise
    autocast: bool = False  # the forward/backward really ran under autocast
    accumulation_policy: str = "no_sync"  # accum_kit.engines.policies: what the windows skipped and kept
    data: dict = field(default_factory=dict)  # description, items (what N counts), token_data
    batchnorm: dict | None = None  # the BatchNorm finding (accum_kit.verify.batchnorm.summarize), None: no such layer
    router: dict | None = None  # mixture of experts: the per-micro-batch aux loss's deviation (accum_kit.verify.router)
    compile: dict | None = None  # torch.compile settings and this process's counts (verify.accelerator.CompileRecord)
    engine: str = "ddp"  # the run's engine (accum_kit.engines.base.Engine.name); words the text only
    casts_model: bool = False  # the engine casts the model itself (Engine.casts_model: DeepSpeed); words the text only
    data_parallel_size: int | None = None  # processes reading different examples (None: world_size)
    token_ranks: int | None = None  # processes holding different tokens, over which a window's tokens are counted
    gradient_mean_size: int | None = None  # processes the engine averages a gradient over (None: world_size)
    mesh: dict | None = None  # the sharded run's mesh sizes (Mesh.to_dict() and world_size), None without one

    def row(self, name: str) -> Row:
        """The row called ``name`` (StopIteration if none)."""
        return next(r for r in self.rows if r.name == name)

    @property
    def selected_row(self) -> Row:
        return self.row(SELECTABLE[self.selected])

    @property
    def passed(self) -> bool:
        """The row selected by ``--loss_normalization`` matched the oracle."""
        return bool(self.selected_row.passed)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def ddp_sum_ratio_expected(self) -> float:
        return 1.0 / self.averaged_over

    @property
    def averaged_over(self) -> int:
        """Processes the engine averages each gradient over (FSDP2 under tp: not the tp ranks)."""
        return self.gradient_mean_size or self.world_size

    def to_dict(self) -> dict:
        """JSON-ready dict: the fields, ``rows`` keyed by name, and the derived verdict fields."""
        d = {k: v for k, v in asdict(self).items() if k not in _TEXT_ONLY}
        d["rows"] = {r.name: asdict(r) for r in self.rows}
        d.update(passed=self.passed, exit_code=self.exit_code, selected_row=self.selected_row.name,
                 ddp_sum_ratio_expected=self.ddp_sum_ratio_expected, ddp_semantics=self.ddp_statement())
        return d

    @property
    def reducer(self) -> str:
        """What averages the gradients over processes: DDP's all-reduce, FSDP2's reduce-scatter or ZeRO's reduction."""
        return REDUCERS.get(self.engine, "DDP")

    def ddp_statement(self) -> str:
        """One sentence: what DDP does to a sum loss, with the measured ratio."""
        w, r = self.averaged_over, self.ddp_sum_ratio
        if r is None:
            return (f"DeepSpeed's engine divides each micro-batch's loss by K={self.gradient_accumulation_steps} "
                    f"and averages over the {w} processes (no sum row)")
        if w == 1:
            return (f"1 process, no DDP: sum-loss gradient = big-batch sum gradient x 1 "
                    f"(measured ratio {r:.4f}, residual {self.ddp_sum_residual:.1e})")
        return (f"{self.reducer} averages: sum-loss gradient = big-batch sum gradient x 1/{w} "
                f"(measured ratio {r:.4f}, residual {self.ddp_sum_residual:.1e})")

    def format(self) -> str:
        """The text report: setup, one table row per normalisation, the DDP statement, the verdict."""
        return "\n".join([*self._setup_lines(), "", *self._table_lines(), "", *self._conclusion_lines()])

    def _setup_lines(self) -> list[str]:
        K, B, W = self.gradient_accumulation_steps, self.per_device_train_batch_size, self.world_size
        m, items = self.model, self.items
        lines = [
            "accum-kit verify: accumulated gradient vs one big batch on one process",
            f"  processes {W} ({self.distributed_type}, accumulation policy {self.accumulation_policy}), "
            f"gradient_accumulation_steps K={K}, "
            f"per_device_train_batch_size {B}, seed {self.seed}",
            f"  model: {m['description']}, {m['parameters']:,} parameters, {self._weights()}{self._compute()}, "
            "dropout off (eval mode)",
            f"  data: {self.data.get('description', '')}",
        ]
        if self.mesh is not None and self.data_parallel_size != W:
            lines.append(self._mesh_line())
        if self.compile is not None:
            lines.append(self._compile_line())
        for w in self.windows:
            kind = (f"partial, {w.micro_batches_per_process} of {K} micro-batches per process "
                    "(the epoch's last window, closed at the end of the dataloader)" if w.partial
                    else f"full, {K} micro-batch{'es' if K > 1 else ''} per process")
            lines.append(f"  window #{w.index}: {kind}; {w.examples} examples, {w.target_tokens} {items}")
        if not self.partial_window:
            lines.append("  no partial window (--no_partial_window)")
        elif K == 1:
            lines.append("  no partial window: with K=1 every window is full")
        together = "padded together" if self.data.get("token_data", True) else "collated together by collate_fn"
        lines += [
            f"  oracle: plain PyTorch, one process, {self.oracle['dtype']} on {self.oracle['device']}: one "
            f"forward/backward per window over all processes' examples {together}; gradient of the summed "
            f"loss / the window's {items} N (mean), or of the summed loss (sum)",
            self._tolerance_line(),
        ]
        return lines

    def _mesh_line(self) -> str:
        sizes = " x ".join(f"{k.removesuffix('_size')} {v}" for k, v in self.mesh.items()
                           if k != "world_size" and (v > 1 or k == "dp_shard_size"))
        return (f"  mesh: {sizes}: {self.data_parallel_size} data-parallel ranks read different examples (each "
                f"taken once by the oracle), tokens counted over the {self.token_ranks} ranks holding different "
                f"tokens (data-parallel x cp{', never per tp rank' if self.mesh.get('tp_size', 1) > 1 else ''}), "
                f"{self.reducer} averages over {self.averaged_over}")

    def _compile_line(self) -> str:
        c = self.compile
        where = "per block (regional)" if c["regional"] else "whole model"
        shapes = "symbolic shapes" if c.get("dynamic") else "static shapes"
        return (f"  compiled: torch.compile backend {c['backend']}, mode {c['mode']}, {where}, {shapes}; "
                f"{c['compiles']} compiles, {c['graphs']} graphs, {c['recompiles']} recompiles, "
                f"{c['compile_seconds']:.1f} s compiling (main process); the oracle runs eagerly")

    @property
    def items(self) -> str:
        """What N counts: "target tokens" (verify's token data) or "items" (a user's loss_fn)."""
        return self.data.get("items", "target tokens")

    def _weights(self) -> str:
        """"float32, " unless the engine casts the model itself (DeepSpeed; then :meth:`_compute` says to what)."""
        return "" if self.casts_model and self.mixed_precision != "no" else "float32, "

    def _compute(self) -> str:
        if self.mixed_precision == "no":
            return "float32 compute"
        if self.casts_model:
            return (f"{self.mixed_precision} weights, activations and gradients (DeepSpeed casts the model; its "
                    "optimizer keeps float32 master weights)")
        if not self.autocast:
            return f"--mixed_precision {self.mixed_precision} but no autocast on {self.oracle.get('device')} (float32 compute)"
        return f"{self.mixed_precision} autocast"

    def _tolerance_line(self) -> str:
        if not self.normwise:
            return (f"  tolerance (float32): pass iff |g - g_oracle| <= atol + rtol |g_oracle| for every element, "
                    f"rtol {self.rtol:g}, atol {self.atol:g} (x N for sum rows); worst/tol = the largest "
                    "|g - g_oracle| / (atol + rtol |g_oracle|)")
        return (f"  tolerance ({self.mixed_precision}): pass iff ||g - g_oracle|| / ||g_oracle|| <= rtol {self.rtol:.3g} "
                "per window (normwise; rtol = sqrt(m) u, u the unit roundoff, m = 64 roundings, independent errors "
                "adding in quadrature; see accum_kit.verify.compare); worst/tol = the largest rel err / rtol")

    def _table_lines(self) -> list[str]:
        head = ["normalisation", "computed by", "compared with", "max abs err",
                *[f"rel err #{w.index}" for w in self.windows], "worst/tol", "result"]
        table, notes = [], []
        for r in self.rows:
            cells = [r.name, r.computed_by, r.compared_with]
            if r.skipped:
                table.append(cells + ["-"] * (len(head) - 4) + ["skipped"])
                notes.append(f"  {r.name} skipped: {r.skipped}")
            else:
                verdict = "info" if r.informational else ("PASS" if r.passed else "FAIL")
                table.append(cells + [f"{r.max_abs_error:.2e}", *[f"{x['rel_error']:.2e}" for x in r.windows],
                                      f"{r.tolerance_used:.3g}", verdict])
                if r.summary is not None and "reproduces" in r.summary:
                    notes += self._miscount_notes(r)
                elif r.summary is not None:
                    notes += self._trainer_notes(r)
        text = tabulate(table, headers=head, tablefmt="simple", disable_numparse=True)
        return ["  " + line for line in text.splitlines()] + notes

    def _miscount_notes(self, r: Row) -> list[str]:
        """A miscount row's size against the oracle and the public bug it reproduces (informational)."""
        s = r.summary
        return [f"  {r.name} (informational, exit code unaffected): max abs err {r.max_abs_error:.2e}, worst/tol "
                f"{r.tolerance_used:.3g}, update = oracle x{s['factor']:.4f} in size; reproduces {s['reproduces']}"]

    def _trainer_notes(self, r: Row) -> list[str]:
        """The ``trainer`` row's size, direction and cause (informational: no effect on the verdict)."""
        s, K = r.summary, self.gradient_accumulation_steps
        per_window = ", ".join(
            f"#{w['window']} x{w['factor']:.7f} (N/(N+examples) = {w['target_tokens']}/"
            f"{w['labels_counted_before_shift']} = {w['predicted_if_unshifted']:.7f})" for w in r.windows)
        lines = [f"  trainer (informational, exit code unaffected): update = oracle x{s['factor']:.7f} in size "
                 f"(1 - x = {1 - s['factor']:.1e}), direction cosine >= {s['cosine']:.9f}",
                 f"  trainer, per window: {per_window}",
                 f"  trainer, why: {s['cause']}"]
        partial = [w for w, info in zip(r.windows, self.windows) if info.partial]
        if partial:
            how = ("exact" if s["exact"] else "its own N / (N + examples), like the full windows"
                   if s["labels_counted_before_shift"] else f"x{partial[0]['factor']:.7f}")
            lines.append(f"  trainer, partial window: Trainer closes the epoch's last window after its "
                         f"{self.windows[-1].micro_batches_per_process} of {K} micro-batches and divides it by its own "
                         f"label count (not by K): {how}")
        if not s.get("same_examples_as_tokens_row", True):
            lines.append("  trainer: its windows held other examples than the tokens row's (compared with their own oracle)")
        return lines

    def _conclusion_lines(self) -> list[str]:
        W, G = self.world_size, self.averaged_over
        measured = [r for r in self.rows if r.rank_spread is not None]  # the DDP rows (and Trainer's)
        lines = [f"  {self.ddp_statement()}"]
        if self.dataparallel_sum_ratio is not None:
            lines.append(f"  DataParallel sums the replicas' gradients: sum-loss gradient = big-batch sum gradient x 1 "
                         f"(measured ratio {self.dataparallel_sum_ratio:.4f})")
        lines.append(f"  ranks agree: gradient norms differ by at most {max(r.rank_spread for r in measured):.1e} "
                     f"(relative) across the {W} process(es)")
        items = self.items
        over = "all processes" if self.data_parallel_size in (None, W) else f"the {self.token_ranks} token ranks"
        why = (f"  why: tokens divides the summed loss by the window's {items} over {over} (exact); "
               f"mean-of-means weights micro-batches with fewer {items} more and still divides a partial window by K")
        lines.append(why + (f"; sum is {G}x too small because {self.reducer} averages over {G} processes"
                            if G > 1 and self.ddp_sum_ratio is not None else ""))
        if self.batchnorm is not None:
            lines += finding_lines(self.batchnorm, self.gradient_accumulation_steps,
                                   self.per_device_train_batch_size, W, self.rtol)
        if self.router is not None:
            from .router import finding_lines as router_lines

            lines += router_lines(self.router)
        lines.append(f"  verdict: {self.selected_row.name} (--loss_normalization {self.selected}) "
                     f"{'PASSES' if self.passed else 'FAILS'} -> exit {self.exit_code}   ({self.seconds:.1f} s)")
        return lines
