"""How much a bounded cache costs: perplexity of a long text per policy and budget.

    positronic eval --budget 128 --budget 256 --max-tokens 1024 --out bench/eval_results
    python run.py eval --policy h2o --policy streaming --budget 64 --text my.txt

    from positronic.evaluate import evaluate, write_outputs
    report = evaluate(lm, text, policies=["streaming", "h2o"], budgets=[128], max_tokens=512)
    report.runs[0].ppl, report.runs[0].ratio, report.runs[0].probe.recalled

Teacher forcing through the real tick machinery: the text is tokenized (BOS first) and fed
one token per tick through a `Brain` (the same loop as a run), each tick's token forced
instead of sampled (`Brain.step(force=token)`). At each tick the NLL of the true next token
is read from the state's next-token logits (log-softmax) *before* it is added; then the tick
runs as it would in a run: the policy plans from the newest token's attention, and its
actions plus the `add` of the true token go through Step 4. So every policy sees, edits and
is scored on the same cache the generator would have; brightness repairs when a repairer is
set (`--repairer bridge|self`; the default culls). A tick that fails changes nothing, so it is run again with the
same token (a second failure ends the evaluation).

Reported per (policy, budget): perplexity exp(mean NLL) over all predicted tokens and over
`segments` equal consecutive chunks, and the ratio to the full cache over the same tokens.
The full-cache reference is policy `none` with a budget above the stream length (so nothing
is ever evicted); it is run automatically whenever the stream fits the model's positions
(when only the probe fits, it runs the probe alone: its perplexity cells stay empty).
`none` below that budget follows `at_capacity`: `shift` (default here; llama.cpp's context
shift) or `stop` (the run ends when the cache is full; later tokens are not scored and the
coverage column says how many were).

Retrieval probe: BOS, the first k of `probe_filler` text tokens, a fact ("The secret code is
4817. ..."), the rest of the filler, then the question "... Answer: The secret code is " (its
trailing space is one token, as in the fact); the answer "4817" (one token per digit in
SmolLM2 and Llama tokenizers) is teacher-forced. k = round(probe_at * filler): `probe_at` 0
(default) puts the fact first, 1 right before the question. The fact never lands in the rows
no policy evicts (the first max(sinks, protect) rows, BOS included): it is shifted to start
right after them (k raised to max(sinks, protect) - 1), so it survives only if the policy
keeps it; a filler too short for that is refused. The filler is taken from the whole text
(not only the first `max_tokens`); a text shorter than an explicit `probe_filler` is refused
(the default, the largest budget + 128 so that every bounded cache has had to evict, is cut
to the text), and so is a probe stream longer than the model's positions.
Recorded per run: the answer's NLL in nats (sum over its tokens), the full cache's answer NLL
and the difference `delta` ("Δ nats vs full"; the target: within 1 nat over the
4-digit answer), the rank of each answer token under the next-token distribution, and
`recalled` = every answer token ranked first (greedy decoding would reproduce the code).

`kv_format` (`eval --kv-format int4|fp4|int4h`) stores every run's cache rows, the full cache's
included, in that 4-bit format (positronic/kv/formats.py); the table's title and the settings
give the format and its cache bytes per token. Compare two evals to see what the format costs.

`recall=True` (`eval --recall`) runs every bounded policy (all but `none`) a second time
with BrainConfig.recall on, labelled e.g. "brightness+recall", next to the run without.

Outputs (`write_outputs`): results.csv (one row per run), results.json (settings, every run
with its per-token NLL), nll_by_position.png (moving-average NLL over position, one subplot
per budget, one line per policy, the full cache dashed).

    stream.py   run_stream (teacher forcing), perplexity, the run configs
    probe.py    the retrieval probe's stream and result
    sweep.py    evaluate(): every (policy, budget) and the reference; EvalReport
    report.py   the table, results.csv / .json, the plot
    cli.py      main(): `positronic eval`
"""

from ..texts import DEFAULT_TEXT
from .cli import main, read_text
from .probe import PROBE_ANSWER, PROBE_FACT, PROBE_QUESTION, ProbeResult, ProbeStream, probe_stream, run_probe
from .report import fmt_number, moving_average, plot, probe_cells, progress_bars, table, table_console, write_outputs
from .stream import (EvalError, RunSettings, StreamResult, make_config, perplexity, reference_config, run_stream,
                     segment_bounds)
from .sweep import DEFAULT_BUDGETS, DEFAULT_POLICIES, EvalReport, RunSummary, evaluate

__all__ = [
    "DEFAULT_BUDGETS", "DEFAULT_POLICIES", "DEFAULT_TEXT", "PROBE_ANSWER", "PROBE_FACT", "PROBE_QUESTION", "EvalError",
    "EvalReport", "ProbeResult", "ProbeStream", "RunSettings", "RunSummary", "StreamResult", "evaluate", "fmt_number", "main",
    "make_config", "moving_average", "perplexity", "plot", "probe_cells", "probe_stream", "progress_bars",
    "read_text", "reference_config", "run_probe", "run_stream", "segment_bounds", "table", "table_console",
    "write_outputs",
]
