"""A model's chat template is untrusted code: `msrl validate` refuses one that the sandbox stops, that raises, that
leaves out a role the run needs, that moves messages out of order, or that does not finish rendering in a few
seconds (data/template_check.py, run by training/preflight.py); the message names the template's file and what is
wrong, exit 2, no traceback, and nothing a payload would do was done. A demonstrated assistant turn holding an
`env.turn_stop` string is refused with file:line. Each template is written by hand into a copy of a tiny model's
tokenizer_config.json; the expected text of every message is written out here.

    .venv/bin/python -m pytest -q tests/unit/test_chat_template_checks.py
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from megatron_sparse_rl.data import load_tokenizer, template_check
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from megatron_sparse_rl.tools import cli

ROOT = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A sound template (ChatML, Qwen's shape)."""
EPISODE_ROLES = ("user", "assistant", "tool")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", seed=1)


def with_template(tiny: Path, tmp_path: Path, template: str) -> Path:
    """A copy of the tiny model whose tokenizer_config.json holds `template`."""
    out = tmp_path / "model"
    shutil.copytree(tiny, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    return out


def validate(model: Path, tmp_path: Path, capsys, *sets: str) -> tuple[int, str]:
    """`msrl validate configs/tool_calc.yaml` (episodes with the calc tool) on `model`: (exit code, stderr)."""
    code = cli.main(["validate", str(ROOT / "configs/tool_calc.yaml"), "--set", f"model.path={model}",
                     "model.tiny=null", f"logging.dir={tmp_path / 'run'}",
                     f"data.path={ROOT / 'megatron_sparse_rl/assets/tool_calc/train.jsonl'}",
                     f"data.eval_path={ROOT / 'megatron_sparse_rl/assets/tool_calc/eval.jsonl'}",
                     "data.max_prompt_tokens=64", "rollout.max_model_len=192", *sets])  # ChatML's longer prompts
    return code, capsys.readouterr().err


def test_a_template_the_sandbox_stops_is_refused_and_its_payload_never_runs(tiny, tmp_path, capsys):
    marker = tmp_path / "pwned"
    payload = ("{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
               "{{ ''.__class__.__mro__[1].__subclasses__() }}" + CHATML)
    code, err = validate(with_template(tiny, tmp_path, payload), tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"error: model.path '{tmp_path / 'model'}': the chat template in "
                           f"{tmp_path / 'model' / 'tokenizer_config.json'} was stopped by the sandbox: SecurityError: "
                           "access to attribute '__init__' of 'type' object is unsafe. (rendering user); env.kind = "
                           "'tools' renders user, assistant and tool messages")
    assert not marker.exists()


def test_a_template_that_raises_is_refused_at_validate_and_per_record(tiny, tmp_path, capsys):
    refuses_tools = ("{% for m in messages %}{% if m['role'] == 'tool' %}"
                     "{{ raise_exception('only user and assistant roles are supported') }}{% endif %}{% endfor %}"
                     + CHATML)
    code, err = validate(with_template(tiny, tmp_path, refuses_tools), tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    assert "tokenizer_config.json raised TemplateError: only user and assistant roles are supported (rendering " \
           "user, assistant, tool)" in err
    # without episodes the probes need no tool message, and the data's demonstrations hold one: the first record
    # that makes the template raise is named by file and line
    code, err = validate(tmp_path / "model", tmp_path, capsys, "env.kind=none")
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"error: {ROOT / 'megatron_sparse_rl/assets/tool_calc/train.jsonl'}:1: the chat template "
                           "raised TemplateError: only user and assistant roles are supported (rendering user, "
                           "assistant, tool)")


def test_a_template_without_the_tool_role_is_refused(tiny, tmp_path, capsys):
    no_tool = CHATML.replace("{% for m in messages %}", "{% for m in messages if m['role'] != 'tool' %}")
    code, err = validate(with_template(tiny, tmp_path, no_tool), tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    assert f"the chat template in {tmp_path / 'model' / 'tokenizer_config.json'} leaves out the content of the " \
           "'tool' message (rendering user, assistant, tool, generation prompt); env.kind = 'tools' renders user, " \
           "assistant and tool messages" in err


def test_a_template_that_reorders_messages_is_refused_and_a_sound_one_passes(tiny, tmp_path, capsys):
    code, err = validate(with_template(tiny, tmp_path, CHATML), tmp_path, capsys)
    assert code == 0, err
    reversed_ = CHATML.replace("{% for m in messages %}", "{% for m in messages|reverse %}")
    shutil.rmtree(tmp_path / "model")
    code, err = validate(with_template(tiny, tmp_path, reversed_), tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    assert "tokenizer_config.json moves the messages out of order (given user, assistant; rendered assistant, " \
           "user)" in err


def test_a_template_that_never_finishes_is_stopped_within_its_bound(tiny, tmp_path, capsys, monkeypatch):
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML
    model = with_template(tiny, tmp_path, forever)
    code, err = validate(model, tmp_path, capsys)
    assert code == 2 and "Traceback" not in err
    assert f"tokenizer_config.json did not finish rendering within {template_check.RENDER_TIMEOUT_S:g} s " \
           "(stopped)" in err
    # the bound, timed from the renderer's "ready" to the answer, with a 0.5 s deadline; the child is gone after
    seen, line = [], template_check._line

    def timed(child, deadline):
        out = line(child, deadline)
        seen.append((time.monotonic(), child))
        return out

    monkeypatch.setattr(template_check, "_line", timed)
    problem = template_check.chat_template_problem(load_tokenizer(model), "tokenizer_config.json", EPISODE_ROLES,
                                                   timeout_s=0.5)
    assert problem == "the chat template in tokenizer_config.json did not finish rendering within 0.5 s (stopped)"
    (ready, child), (answered, _) = seen
    assert 0.5 <= answered - ready < 2.0, answered - ready
    assert child.poll() is not None  # killed and reaped


def test_a_demonstrated_turn_holding_the_turn_stop_is_refused_with_file_and_line(tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "12*3="}, {"role": "assistant", "content": "calc(12*3)"},
                         {"role": "tool", "content": "36"}, {"role": "assistant", "content": "36"}], "answer": "36"}
    bad = json.loads(json.dumps(good))
    bad["messages"][3]["content"] = "the answer is\n36"
    data = tmp_path / "demo.jsonl"
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    code = cli.main(["validate", str(ROOT / "configs/tool_calc.yaml"), "--set", f"data.path={data}",
                     "data.eval_path=''", f"logging.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'm'}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"error: {data}:2: messages[3], an assistant turn of the demonstration, holds '\\n', a stop "
                           "string of env.turn_stop: an episode's turn ends there, so the model could never write "
                           "this turn whole; split it into turns or remove the string")
    # without episodes there is no turn stop: the same data passes
    code = cli.main(["validate", str(ROOT / "configs/tool_calc.yaml"), "--set", f"data.path={data}",
                     "data.eval_path=''", f"logging.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'm'}",
                     "env.kind=none"])
    assert code == 0, capsys.readouterr().err
