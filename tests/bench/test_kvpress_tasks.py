"""bench/kvpress_tasks.py's project side: `export` writes the very instances `eval --task` makes
(kvpress's side runs in kvpress's own venv, which CI does not build)."""

import json

from positronic.evaluate import DEFAULT_TEXT
from positronic.evaluate.tasks import make_instances


def test_export_writes_the_instances_eval_task_makes(tmp_path, tiny, run_script):
    out = tmp_path / "instances.json"
    run_script("kvpress_tasks", "export", "--model", "random:tiny", "--text", str(DEFAULT_TEXT), "--task", "needle",
               "--task", "recall", "--context", "160", "--instances", "2", "--out", str(out), check=True)
    written = json.loads(out.read_text())
    made = [instance for task in ("needle", "recall")
            for instance in make_instances(tiny, task, DEFAULT_TEXT.read_text(encoding="utf-8"), context=160, count=2)]
    assert written["context"] == 160 and written["filler"] == DEFAULT_TEXT.name
    assert [(i["task"], i["ids"], i["question_at"], i["answer_at"], i["answer"]) for i in written["instances"]] == \
        [(i.task, i.ids, i.question_at, i.answer_at, i.answer) for i in made]
