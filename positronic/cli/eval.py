"""The eval command (`positronic eval`): perplexity through a bounded cache per policy and
budget, or with --generate the quality of freely generated text. The work is in
positronic/evaluate/, imported only when the command runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..brain.config import MEMORY_RANKS
from ..brain.session import MAX_TICK
from ..kv.cache import STORES
from ..util import MAX_TEXT_BYTES
from .common import DEFAULTS, MAX_THREADS, UserError, given_flags, set_threads, writable_directory

# options that only one mode reads: given to the other, they would be silently ignored
GENERATE_ONLY = ("prompt_tokens",)
TASK_ONLY = ("context", "instances")
TEACHER_FORCED_ONLY = ("max_tokens", "segments", "probe", "probe_filler", "probe_at", "smooth")
PROBE_ONLY = ("probe_filler", "probe_at")


def eval_command(
    ctx: typer.Context,
    model: str = typer.Option("smollm2", "-m", "--model", help="Model, as for the run command."),
    text: Optional[Path] = typer.Option(None, help="Text file to feed (default: texts/alice_ch1-2.txt)."),
    budget: Optional[list[int]] = typer.Option(None, help="Cache budget; repeat for several (default 128 256 512)."),
    policy: Optional[list[str]] = typer.Option(None, help="Policy; repeat for several (default: brightness, streaming, scored, h2o, none, and the policy run and serve pick for the model, e.g. smartkv with recall)."),
    max_tokens: int = typer.Option(1024, help="Text tokens to score."),
    out: Path = typer.Option(Path("eval_results"), help="Directory for results.csv/.json and the PNG plot (with --generate: generation.csv/.json, texts/, side_by_side.md)."),
    segments: int = typer.Option(8, help="Perplexity segments reported per run."),
    sinks: int = typer.Option(4, min=0, max=256, help="Attention-sink rows never evicted."),
    protect: int = typer.Option(0, min=0, help="Protected prefix rows."),
    at_capacity: str = typer.Option(DEFAULTS.at_capacity, help="Policy none when full: stop | shift (as for the run command)."),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="Run the retrieval probe too."),
    probe_filler: Optional[int] = typer.Option(None, help="Filler tokens in the probe, from the whole --text (default: max budget + 128, cut to the text; a text shorter than an explicit N is refused, and so is a probe longer than the model's positions)."),
    probe_at: float = typer.Option(0.0, help="Where the probe's fact goes: the fraction 0..1 of the filler before it (0: first, 1: right before the question); never inside the sink/protected rows (shifted past them)."),
    recall: bool = typer.Option(False, "--recall", help="Also run every policy but none with recall on (rows POLICY+recall)."),
    smooth: Optional[int] = typer.Option(None, help="Moving-average window of the plot (tokens)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda."),
    dtype: Optional[str] = typer.Option(None, help="float32 | float16 | bfloat16 | auto: the checkpoint's own dtype (a bf16 checkpoint stays bf16). Default: float16 on cuda, float32 on cpu."),
    weights: Optional[str] = typer.Option(None, help="float32 | bfloat16 | int8 | int8-weight-only | int4 | auto: the CPU linear layers' format (docs/weights.md). auto (default): int8 for a GGUF file of quantized weights (Q4_0, Q4_1, Q8_0, ...), else float32. int4: least memory."),
    repairer: str = typer.Option(DEFAULTS.repairer, help="The brightness policy's repairer: none (cull only) | bridge | self | mlm:PATH."),
    repair_batch: int = typer.Option(DEFAULTS.repair_batch, min=1, help="The brightness policy's rows freed at once at the budget (1 = one per tick)."),
    evict_every: int = typer.Option(0, min=0, help="The shared-row policies (brightness, streaming, scored, h2o, random) edit once every N ticks, freeing N rows; 0: each one's own (llama.cpp's budget/16 + 1; brightness: --repair-batch). smartkv and none keep theirs."),
    generate: Optional[int] = typer.Option(None, max=MAX_TICK, help="Generation mode: each policy and budget generates N tokens from the same prompt and seed; reports re-scored perplexity, distinct-4 and speed, and writes generation.csv/.json, texts/ and side_by_side.md. The teacher-forced perplexity and the probe are not run (--max-tokens, --segments, --probe, --probe-filler, --probe-at, --smooth, --gates, --recall are refused)."),
    prompt_tokens: int = typer.Option(128, max=MAX_TEXT_BYTES + 1, help="With --generate: the prompt is BOS + the first N tokens of --text."),
    seed: int = typer.Option(0, help="With --generate: the sampling seed, the same for every run."),
    kv_format: str = typer.Option(DEFAULTS.kv_format, help="Cache rows: float (the model's dtype) | int4 | fp4 (4 bits + a float16 scale per row) | int4h (4 bits, keys centred before RoPE, K and V Hadamard-rotated, a scale and a zero point per 32 values; docs/kv_formats.md)."),
    kv_store: str = typer.Option(DEFAULTS.kv_store, help="Where cache rows live: splice (default) | ring (policy streaming, float rows: evictions only move a cursor; DESIGN.md §6)."),
    gates: str = typer.Option(DEFAULTS.gates, help="Policy smartkv: a gate file (.safetensors), or auto: the shipped gates, else gates trained on the model's first use and kept (docs/smartkv.md). Default: the gates shipped for the model (auto for the default policy of a model without them)."),
    memory_rank: Optional[str] = typer.Option(None, show_default=False, help="Policy smartkv: how each lane's memory ranks its rows: gates | recent (docs/smartkv.md). Default: recent with --recall, gates without."),
    reread: Optional[bool] = typer.Option(None, "--reread/--no-reread", show_default=False, help="Policy smartkv with recall: recall looks right after each token's forward and rereads that token with what came back (docs/smartkv.md, \"Reread\"). Default: on."),
    policy_option: Optional[list[str]] = typer.Option(None, "--policy-option", help="NAME=VALUE: a setting of the policies made from a press among the --policy runs (e.g. knorm's mix; docs/policies.md, \"A policy in one file\"); repeatable."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=MAX_THREADS, help="CPU threads for torch (default: one per core)."),
    task: Optional[list[str]] = typer.Option(None, help="Task mode: retrieval tasks in the manner of RULER, generated from --seed (needle | multikey | multivalue | variables | recall | all; repeatable): the share of instances each cache answers exactly, the full cache's beside (docs/eval.md, 'Tasks'). --text is the haystack."),
    context: int = typer.Option(2048, help="With --task: tokens of each instance's context (haystack and facts), pruned to the budget before the question comes."),
    instances: int = typer.Option(8, help="With --task: instances of each task."),
) -> None:
    """Perplexity of a text through a bounded cache, per policy and budget, plus a retrieval probe;
    with --generate N, the quality of N freely generated tokens instead; with --task, retrieval
    tasks answered exactly or not."""
    if task and generate is not None:
        raise UserError("--task and --generate are two modes of eval: give one")
    refuse_unread_options(ctx, generate is not None, probe, bool(task))
    if memory_rank is not None and memory_rank not in MEMORY_RANKS:
        raise UserError(f"--memory-rank must be one of {', '.join(MEMORY_RANKS)}, got {memory_rank!r}")
    if kv_store not in STORES:
        raise UserError(f"--kv-store must be one of {', '.join(STORES)}, got {kv_store!r}")
    writable_directory(out, "--out")
    set_threads(threads)
    if not 0 <= seed < 2**63:
        raise UserError(f"--seed must be in 0..2**63-1, got {seed}")
    settings = dict(sinks=sinks, protect=protect, at_capacity=at_capacity, repairer=repairer,
                    repair_batch=repair_batch, evict_every=evict_every, kv_format=kv_format,
                    policy_options=",".join(policy_option or ()))
    # not (yet) read by --generate
    smartkv = dict(gates=gates, kv_store=kv_store, memory_rank=memory_rank, reread=reread)
    common = dict(model=model, text=text, budgets=budget, policies=policy, out=out, device=device, dtype=dtype,
                  weights=weights)
    if task:
        from ..evaluate.tasks import main as tasks_main

        tasks_main(tasks=task, context=context, instances=instances, seed=seed, recall=recall, **common,
                   **settings, **smartkv)
        return
    if generate is not None:
        if recall:
            raise UserError("--recall applies to the teacher-forced eval and its probe, not to --generate")
        if kv_store == "ring":
            raise UserError("--kv-store ring applies to the teacher-forced eval, not (yet) to --generate")
        if reread is not None:  # SmartKVCache, which --generate runs, has no recall
            raise UserError("--reread applies to the teacher-forced eval, not (yet) to --generate")
        if memory_rank == "recent":  # SmartKVCache, which --generate runs, ranks by the gates alone
            raise UserError("--memory-rank applies to the teacher-forced eval, not (yet) to --generate")
        if gates:  # --generate's SmartKVCache runs the gates shipped for the model
            raise UserError("--gates applies to the teacher-forced eval, not (yet) to --generate")
        from ..evaluate.generation import main as generation_main

        report = generation_main(generate=generate, prompt_tokens=prompt_tokens, seed=seed, **common, **settings)
        if any(run.error for run in report.runs + ([report.reference] if report.reference else [])):
            raise typer.Exit(1)  # a run ended on a tick that failed twice: its files are written, but say so
        return
    from ..evaluate import main as evaluate_main

    evaluate_main(max_tokens=max_tokens, segments=segments, probe=probe, probe_filler=probe_filler, smooth=smooth,
                  probe_at=probe_at, recall=recall, **common, **settings, **smartkv)


def refuse_unread_options(ctx: typer.Context, generating: bool, probe: bool, tasks: bool = False) -> None:
    """UserError naming the options given that this eval would not read: the teacher-forced
    eval's with --generate or --task, --generate's and --task's without them, the probe's with
    --no-probe, --seed outside --generate and --task."""
    given = given_flags(ctx)
    for names, applies, to in ((GENERATE_ONLY, generating, "--generate"),
                               (TASK_ONLY, tasks, "--task"),
                               (("seed",), generating or tasks, "--generate and --task"),
                               (TEACHER_FORCED_ONLY, not generating and not tasks,
                                "the teacher-forced eval, not to --generate or --task"),
                               (PROBE_ONLY, generating or tasks or probe, "the retrieval probe (leave out --no-probe)")):
        if unread := [name for name in names if name in given and not applies]:
            flags = ", ".join("--probe/--no-probe" if name == "probe" else "--" + name.replace("_", "-")
                              for name in unread)
            raise UserError(f"{flags} {'apply' if len(unread) > 1 else 'applies'} to {to}")
