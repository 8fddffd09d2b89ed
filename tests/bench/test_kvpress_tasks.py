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


def test_bad_input_is_refused_in_one_line_and_writes_nothing(tmp_path, run_script):
    out = tmp_path / "instances.json"
    done = run_script("kvpress_tasks", "export", "--model", "random:tiny", "--text", str(DEFAULT_TEXT), "--task", "hay",
                      "--out", str(out))
    assert done.returncode != 0 and "unknown task 'hay'" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()
    done = run_script("kvpress_tasks", "run", str(out), "--budget", "64")  # no such file: refused before kvpress loads
    assert done.returncode != 0 and f"cannot read {out}" in done.stderr
    out.write_text(json.dumps({"instances": [{"task": "needle", "ids": list(range(200)), "question_at": 150,
                                              "answer_at": 180}]}))
    done = run_script("kvpress_tasks", "run", str(out), "--budget", "150")
    assert done.returncode != 0 and "below the shortest context (150 tokens)" in done.stderr
