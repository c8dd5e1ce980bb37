"""``accum-kit bench``: what ``no_sync`` accumulation buys, measured side by side.

Run it with::

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml -m accum_kit bench

It sweeps the gradient accumulation steps K (``--accumulation_steps``, default
1 2 4 8 16) over three modes (and, opt-in through ``--modes``, two loops that
average gradients by hand and two peers), on the same model, data and seed:

- ``sync_each_batch``: :func:`accum_kit.train_loop` with Accelerate's
  ``sync_each_batch`` flag on, so every micro-batch's backward all-reduces
  (what a loop that forgets ``no_sync`` costs);
- ``no_sync``: :func:`accum_kit.train_loop` as shipped (all-reduce on the
  window's last micro-batch only);
- ``raw_ddp``: the loop a user writes without Accelerate
  (:func:`accum_kit.reference.raw_ddp.train_raw_ddp`), on a fresh copy of the model
  wrapped in plain ``torch.nn.parallel.DistributedDataParallel`` with the same
  DDP settings, toggling ``model.require_backward_grad_sync = (micro == K - 1)``
  as nanoGPT does, with the same loss arithmetic (summed token loss, gradients
  scaled by ``world_size / N`` once per window after one all-reduce of the
  window's token count) and the same data;
- ``no_sync_fused``, opt-in: ``no_sync`` with :func:`accum_kit.train_loop`'s
  default loss, computed in the output layer in chunks without full-vocabulary
  logits (docs/fused_loss.md). The three modes above all compute the loss from
  the logits (:func:`accum_kit.core.loss.logits_causal_lm_loss`, raw DDP's
  formula), so ``no_sync`` / ``raw_ddp`` is the loop alone; ``no_sync_fused``
  against ``no_sync`` (the loss axis, :mod:`.loss_axis`, :mod:`.report_loss`:
  step time paired per repeat with its interval, the memory saved against the
  memory model's prediction, the first losses) is the loss alone;
- ``manual_allreduce`` and ``manual_allreduce_flat``, opt-in: the raw loop
  on a plain (not DDP-wrapped) copy of the model, averaging the gradients by
  hand after the window's last backward, one ``dist.all_reduce`` per
  parameter as in the PyTorch tutorial or one of all gradients flattened
  (:mod:`accum_kit.reference.manual_allreduce`); the same update as ``no_sync``;
- peers, opt-in (:mod:`accum_kit.bench.peers`): ``trainer``
  (``transformers.Trainer`` with ``average_tokens_across_devices``, its
  prefetched windows and ``no_sync``, on a fresh copy of the model) and
  ``accelerate_guide`` (the loop of Accelerate's gradient accumulation guide:
  the model's mean loss per micro-batch inside ``accelerator.accumulate``).
  Each is timed with the same paired-ratio method in the same run; the report
  gives, per K, accum-kit's (``no_sync``) paired step-time ratio to every
  mode (``no_sync_over_mode``) and every mode's per-step loss minus
  ``no_sync``'s (``loss_max_abs_diff_vs_no_sync``, ``loss_mean_diff_vs_no_sync``).
  They are not in the default because a Trainer run builds a new Trainer,
  Accelerator and DDP wrapper (seconds per run on 2 CPU cores).

``sync_each_batch`` and ``no_sync`` share one prepared model (the run plan puts
one policy or the other in force between runs,
:meth:`accum_kit.core.run_plan.RunPlan.use_policy`, as
:class:`accum_kit.profiler.ABSwitch` does); before
every run the weights and the AdamW state are reset to the same initial
values, so the three modes compute the same losses (the JSON records them and
the largest difference between modes).

Schedule: for each preset, one unrecorded run of every mode (a fresh model's
first steps pay page faults and allocator growth), then for each repeat, for
each K, the modes in an order rotated by one from one (repeat, K) to the
next; each run is ``--warmup_steps`` optimizer steps that are not measured,
then ``--steps`` measured ones. The default (1 measured step, no warm-up, 24
repeats) alternates the modes window by window: each repeat's ratio compares
windows that ran seconds apart, so the machine's slow drift cancels, and the
many repeats narrow the interval; ``--quick`` is the earlier short run (2
steps after 1 warm-up step, 3 repeats). Medians, min / max and quartiles are
over all measured steps of all repeats. Timings come from process 0 (the
processes meet at every all-reduce, so their step times agree); memory is the
maximum over processes. Every run also records the 1-minute load average and
the process's CPU seconds per step (``time.process_time``, which other jobs'
load does not lengthen).

Intervals: every ratio of two modes is paired per repeat (below) and comes
with a 95 % confidence interval, a t-interval on the log of the per-repeat
ratios (:func:`accum_kit.stats.ratio_interval`); ``bench.csv`` has
``<ratio>_ci_low`` / ``<ratio>_ci_high`` next to each ratio, and the tables
mark an interval that contains 1 "not resolved".

Every mode, the peers included, carries the same instrumentation: a
:class:`accum_kit.profiler.CommProfiler` on its DDP model (a comm hook around
the default all-reduce or the ``--comm_hook`` compression hook, counting and
timing every gradient bucket) and the same phase timers around forward,
backward and the optimizer step (for Trainer, driven by a Trainer callback,
forward hooks and its Accelerator's ``backward``; see :mod:`.peers`).

Data are synthetic: uniformly random token ids (``--vocab_size``, default 384,
the size of the byte tokenizer the train job uses), every position a target,
fixed micro-batches of ``--per_device_train_batch_size`` x ``--block_size``
tokens. Timing does not depend on the token values. ``--variable_targets``
keeps the inputs and shapes but gives every row a random number of targets
(labels -100 after a random length), so micro-batches differ in target tokens:
then the guide's mean of micro-batch means differs from the token mean, which
it equals on the default data.

Derived figures (per preset; seconds):

- ``c``: compute per micro-batch = median forward + backward of the no-sync
  micro-batches of the ``no_sync`` mode (all K >= 2, all repeats);
- ``a``: exposed all-reduce per synchronised backward = median backward of
  ``sync_each_batch`` micro-batches minus median backward of ``no_sync``'s
  no-sync micro-batches (0 if negative);
- ideal ``no_sync`` step time ``K c + a``, ideal ``sync_each_batch`` step time
  ``K c + K a``, ideal speedup ``(K c + K a) / (K c + a)``; the measured
  speedup is ``sync_each_batch`` / ``no_sync`` step time, also shown as a
  fraction of the ideal. Ratios of two modes (this one and ``no_sync`` /
  ``raw_ddp``) are paired: the median over repeats of the ratio of the two
  runs' median steps within one (repeat, K) block, which ran back to back
  (the ratio of the pooled medians is in the JSON too);
- ``overhead``: measured ``no_sync`` step minus ``K c + a`` (optimizer step,
  gradient rescale, the token-count all-reduce, data loading); the ideal
  speedup with it added to both sides is ``ideal_speedup_with_overhead``;
- ``other``: per step, the time outside the timed phases (forward,
  backward, optimizer step incl. rescale and token-count all-reduce):
  fetching batches and the loop's own code. It is where the toolkit's loop
  could cost more than the raw loop, measured directly rather than as the
  difference of two whole steps, which the machine's noise can swamp;
- exposed communication share of a mode: syncs per step x ``a`` / its step time;
  all-reduce busy share: time with a gradient all-reduce in flight (first
  bucket handed over to last bucket done, overlapped or not) / step time.

Peak memory per run: on CPU the process's resident set high-water mark
(``VmHWM`` in ``/proc/self/status``), reset before each run by writing 5 to
``/proc/self/clear_refs``; on CUDA ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` (:mod:`accum_kit.bench.peak_memory`).

Bars, printed PASS / FAIL / UNRESOLVED / SKIP (checked on what this one run
measured, never in unit tests; :func:`accum_kit.bench.report_ddp.evaluate_bars`),
judged by the 95 % intervals, not the point estimates: PASS when the whole
interval meets the bar, FAIL when none of it does, UNRESOLVED otherwise. On
the communication-heavy preset at K=8, ``no_sync`` must be at least 1.25x
faster than ``sync_each_batch`` and reach at least 90 % of the ideal speedup;
the ``no_sync`` step time must be at most 1.03x the ``raw_ddp`` one at every
K; peak memory at K=16 must be at most 1.05x that at K=1.

Under an FSDP2 launch (``accelerate launch --config_file accelerate_configs/cpu_fsdp.yaml -m accum_kit
bench``) the sweep compares the accumulation policies (``--accumulation_policies``, default all four) per K
instead of the modes above: step time with a paired 95 % interval of the speedup over ``sync_each_batch``,
reduce-scatters and all-gathers per step, bytes, gradient memory held between micro-batches against its
prediction, the ideal step from the profile, and a plot of seconds saved against memory added
(:mod:`.part_fsdp2`; docs/fsdp_costs.md). The policies run the loss from the logits; ``<policy>_fused`` in
``--accumulation_policies`` (e.g. ``no_sync_fused``) adds that policy with the default fused loss to the
rotation, reported as the loss axis against ``<policy>``.

Under a DeepSpeed launch (``accelerate launch --config_file accelerate_configs/cpu_deepspeed.yaml -m accum_kit
bench``) it compares the ZeRO stages (``--zero_stages``, default 1 2 3) per K, one engine per stage and K in the
same processes, windows rotated across them: step time with a paired 95 % interval of the ratio to ZeRO-1,
collectives per step, the time in the gradient reduction path, gradient and parameter memory held against
their prediction, and the profiler's estimate of ZeRO-1's saving over ZeRO-2 (:mod:`.part_zero`; docs/deepspeed.md).

On one process (``accelerate launch --config_file accelerate_configs/cpu_single.yaml -m accum_kit bench``, plain
``python -m accum_kit bench``, or one GPU) there is no DDP wrapper, so no mode above means anything; the bench
compares instead (:mod:`.part_single`, ``--modes``, default all) accum-kit's loop with the loss from the logits
(``kit``) and with its default fused loss (``kit_fused``), a plain PyTorch loop
(``plain``: the model's own loss given ``labels``, ``torch.autocast``, :mod:`accum_kit.reference.plain_loop`) and
the peers ``accelerate_guide`` and ``trainer``, on the same weights, data, optimizer (``--optim``), precision
(``--mixed_precision``) and clipping (``--max_grad_norm``): per K and arm s/step with the paired ratio to
``plain`` and its 95 % interval, tokens/s, model FLOPs utilisation (6 x parameters x tokens/s over a datasheet
peak for H100 / H200 / A100, else a matmul measured here; :mod:`.peak_flops`), peak memory and the rise of
tensor memory over the run's start and its prediction, the loss difference from ``plain``, the loss axis
(``kit_fused`` against ``kit``), and the targets (each kit arm / plain at most 1.02; ``kit_fused``'s tensor peak
below plain's by one float32 logits copy and within 10 % of its prediction). ``--model_presets gpt2 --vocab_size 50257
--block_size 1024`` is GPT-2 small's shape.

``--torch_compile`` (:mod:`.part_compiled`) runs instead the ``no_sync`` loop compiled against eager (on one process,
the prepared model compiled itself), paired and interleaved per K, with compile seconds and the break-even step
count (``compile.json``; docs/compile.md).

``--gradient_checkpointing_ab`` (:mod:`.checkpointing_ab`) gives every arm (DDP: ``sync_each_batch``, ``no_sync``,
``raw_ddp``; FSDP2 / HSDP: each policy) a twin with activation checkpointing (``<arm>+gc``, a second copy of the
model, same weights and data) run next to it, and reports per arm and K the step time with / without
checkpointing with its 95 % interval and the peak memory of each (:mod:`.report_checkpointing`;
``--gradient_checkpointing`` instead checkpoints every arm).

``--tune`` (:mod:`.part_tune`) runs instead the ``no_sync``
loop at one K under several DDP settings, each on its own copy of the model:
the bench's own DDP flags, then each bucket size of ``--tune_bucket_cap_mb``,
``gradient_as_bucket_view``, ``static_graph`` and ``find_unused_parameters``
changed one at a time. Per setting: exposed communication per sync against
its limit ``max(0, all-reduce - backward)``, s/step and its paired ratio to
the base with intervals, peak memory; then it recommends the setting that is
resolvably faster than the base, or says none is (tune.json, tune.csv).

Modules, one way: :mod:`.bench_config` (flags) -> :mod:`.sweep` (the one sweep, the same under every engine)
with the run's part (:mod:`.parts`: the engine's, chosen by the launch's engine name; :mod:`.part_ddp` with
:mod:`.peers`, :mod:`.part_tune`, :mod:`.part_fsdp2`, :mod:`.part_zero`, :mod:`.part_compiled`, one process
:mod:`.part_single`), using
:mod:`.runs`, :mod:`.bench_data`, :mod:`.peak_memory`, :mod:`.run_records`, :mod:`.saving_parts` ->
:mod:`.bench_report` (pairs, intervals, verdicts) and a ``report_<part>`` module per part (figures) -> :mod:`.bench_tables` (text) and
:mod:`.bench_files` (the one writer: JSON, CSV, PNG); the report side imports nothing from the sweep.

Outputs in ``--output_dir`` (default ``runs/bench``), each written atomically:
``bench.json`` (everything, including every run), ``bench.csv`` (one row per
preset x K x mode) and ``bench.png`` (step time against K per mode with the
ideal, and the share of time spent in communication).
"""

from __future__ import annotations

from .bench_config import ALL_MODES, COMM_HOOKS, MODES, PEERS, BenchConfig
from .sweep import run

__all__ = ["ALL_MODES", "ARGUMENTS", "COMM_HOOKS", "DESCRIPTION", "MODES", "PEERS", "BenchConfig", "run", "run_command"]

ARGUMENTS = BenchConfig
DESCRIPTION = (
    "Step time, communication and peak memory of sync_each_batch, no_sync (accum_kit.train_loop) and a "
    "hand-written raw DDP loop over gradient accumulation steps K, side by side, with the ideal no_sync "
    "speedup and a 95 percent interval for every ratio; opt-in modes (--modes ...): manual_allreduce and "
    "manual_allreduce_flat (gradients averaged by hand, no DDP), and the peers trainer (transformers' Trainer) "
    "and accelerate_guide (the loop of Accelerate's gradient accumulation guide), with their loss difference "
    "from accum-kit. --tune: DDP's settings at one K instead. Run under: accelerate launch --config_file "
    "accelerate_configs/cpu_ddp.yaml -m accum_kit bench. On one process (accelerate_configs/cpu_single.yaml, one "
    "GPU, or python -m accum_kit bench): accum-kit's loop against a plain PyTorch loop, accelerate_guide and "
    "trainer, with s/step and its interval, tokens/s, MFU and peak memory.")


def run_command(cfg: BenchConfig) -> int:
    """``accum-kit bench``: run the sweep and write its files; 0 on success (bad input raises, the CLI exits 2).

    The launch's engine picks the part that runs (:mod:`accum_kit.bench.parts`): on one process the kit's loop
    against a plain loop and the peers, under an FSDP2 launch
    (``accelerate_configs/cpu_fsdp.yaml``) the sweep compares the accumulation policies, under DeepSpeed the
    ZeRO stages, under DDP the modes (or ``--tune``'s settings, or ``--torch_compile``'s eager and compiled).
    """
    run(cfg)
    return 0
