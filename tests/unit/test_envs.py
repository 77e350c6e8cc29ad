"""Multi-turn episodes without an engine: the tool registry and `calc`, the tool environment, the chat template of
the character tokenizer, chat (`messages`) data, the `env` config and its refusals, the calc task's data, and the
episode runner's sequence and loss mask over a scripted engine (the real engine: tests/e2e/test_episodes.py).

    .venv/bin/python -m pytest -q tests/unit/test_envs.py
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_sparse_rl.config import ConfigError, RunConfig
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.data import DataConfig
from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.data.datasets import DatasetError, encode_prompts, read_jsonl
from megatron_sparse_rl.data.templates import SIMPLE_CHAT_FORMAT, render_messages, tool_observation
from megatron_sparse_rl.data.types import Example
from megatron_sparse_rl.envs import TOOLS, ToolError, call_tool, register_tool
from megatron_sparse_rl.data.calc_task import calc_records, main as calc_task_main, write_calc_jsonl
from megatron_sparse_rl.envs.tool_env import environment_factory
from megatron_sparse_rl.models.char_tokenizer import character_tokenizer
from megatron_sparse_rl.rollout.batch import RolloutBatch
from megatron_sparse_rl.rollout.outputs import SampledTurn
from megatron_sparse_rl.rollout.multi_turn import run_episodes
from megatron_sparse_rl.tools import cli
from megatron_sparse_rl.training.learner_batch import LearnerBatch
from megatron_sparse_rl.training.preflight import tool_problems

ROOT = Path(__file__).resolve().parents[2]
TOOLS_ENV = ["env.kind=tools", "data.template=chat"]


@pytest.fixture(scope="module")
def tok():
    return character_tokenizer()


def run_of(*overrides: str) -> RunConfig:
    return from_dict(RunConfig, merge_overrides({"model": {"path": "/nonexistent/tiny", "tiny": {}}}, list(overrides)))


# ---- tools --------------------------------------------------------------------------------------------------------

def test_calc_is_exact_on_long_numbers():
    assert call_tool("calc", "123456789*987654321") == "121932631112635269"  # known product
    assert call_tool("calc", " 99999 * 99999 ") == "9999800001"
    assert call_tool("calc", "1000000-1") == "999999" and call_tool("calc", "-5+3") == "-2"


@pytest.mark.parametrize("args", ["2**3", "__import__('os')", "1234567890123*2", "1/2", "", "2*3*4"])
def test_calc_refuses_what_is_not_one_operation(args):
    with pytest.raises(ToolError, match="bad expression"):
        call_tool("calc", args)


def test_registry_refuses_bad_and_taken_names():
    assert "calc" in TOOLS
    with pytest.raises(ToolError, match="no tool nope"):
        call_tool("nope", "1")
    with pytest.raises(ValueError, match="lowercase identifier"):
        register_tool("Bad-Name", str)
    with pytest.raises(ValueError, match="already registered"):
        register_tool("calc", str)


# ---- the tool environment and the chat template --------------------------------------------------------------------

def test_char_chat_template_renders_every_role(tok):
    one = [{"role": "user", "content": "12*3="}]
    assert render_messages(tok, one) == SIMPLE_CHAT_FORMAT.format(prompt="12*3=") == "q: 12*3=\na: "
    convo = one + [{"role": "assistant", "content": "calc(12*3)"}, {"role": "tool", "content": "36"}]
    assert render_messages(tok, convo) == "q: 12*3=\na: calc(12*3)\nr: 36\na: "
    assert render_messages(tok, convo, add_generation_prompt=False) == "q: 12*3=\na: calc(12*3)\nr: 36\n"
    assert tool_observation(tok, "36") == "r: 36\na: "


def test_tool_env_episode_by_hand(tok):
    env = environment_factory(EnvConfig(kind="tools"), tok)()
    sample = Example(prompt="q: 4738291*5821=\na: ", answer="27581591911", ids=(1, 2, 3))
    assert env.reset(sample) == (1, 2, 3)

    def text(s):  # the observation's ids: the character tokenizer's, one per character
        return tuple(tok(s, add_special_tokens=False)["input_ids"])

    call = env.step("calc(4738291*5821)\n")
    assert (call.observation, call.reward, call.done, call.tool_calls, call.tool_errors) == \
        (text("r: 27581591911\na: "), 0.0, False, 1, 0)
    bad = env.step("calc(4738291/5821)")
    assert (bad.observation, bad.tool_errors) == (text("r: error: bad expression\na: "), 1)
    unknown = env.step("lookup(3)")
    assert (unknown.observation, unknown.tool_errors) == (text("r: error: no tool lookup\na: "), 1)
    final = env.step("27581591911\n")
    assert (final.reward, final.done, final.tool_calls) == (1.0, True, 0)
    fresh = environment_factory(EnvConfig(kind="tools"), tok)()
    fresh.reset(sample)
    assert fresh.step("27581591912").reward == 0.0


# ---- chat data --------------------------------------------------------------------------------------------------

def test_messages_data_is_rendered_with_the_chat_template(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "12*3="}], "answer": 36}) + "\n")
    cfg = DataConfig(source="jsonl", path=str(path), prompt_key="messages", template="chat")
    prompts = read_jsonl(path, "messages")
    assert prompts[0].messages == (("user", "12*3="),) and prompts[0].answer == "36"
    (ex,), _ = encode_prompts(prompts, tok, cfg)
    assert ex.prompt == "q: 12*3=\na: " and list(ex.ids) == tok("q: 12*3=\na: ")["input_ids"]
    with pytest.raises(DatasetError, match="needs data.template: chat"):
        encode_prompts(prompts, tok, DataConfig(source="jsonl", path=str(path), prompt_key="messages"))
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}], "answer": 1}) + "\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:1: messages\[0\] needs a role among"):
        read_jsonl(path, "messages")


def test_calc_task_records_are_distinct_correct_and_the_assets_are_reproducible(tmp_path):
    recs = calc_records(200, seed=3)
    pairs = set()
    for r in recs:
        a, b = r["messages"][0]["content"].rstrip("=").split("*")
        assert 4 <= len(a) <= 5 and 4 <= len(b) <= 5 and int(r["answer"]) == int(a) * int(b)
        pairs.add(frozenset((a, b)))
    assert len(pairs) == 200
    train, held_out = write_calc_jsonl(tmp_path)
    for name, path in (("train.jsonl", train), ("eval.jsonl", held_out)):
        assert path.read_text() == (ROOT / "megatron_sparse_rl/assets/tool_calc" / name).read_text()
    questions = [set(json.loads(line)["messages"][0]["content"] for line in p.read_text().splitlines())
                 for p in (train, held_out)]
    assert not questions[0] & questions[1]



def test_calc_task_cli_writes_the_digit_range_asked_and_refuses_a_bad_one(tmp_path, capsys):
    calc_task_main([str(tmp_path), "--train", "30", "--eval", "6", "--min-digits", "2", "--max-digits", "3"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl")]
    for name, count in (("train.jsonl", 30), ("eval.jsonl", 6)):
        records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        assert len(records) == count
        for r in records:
            a, b = r["messages"][0]["content"].rstrip("=").split("*")
            assert 2 <= len(a) <= 3 and 2 <= len(b) <= 3 and r["answer"] == str(int(a) * int(b))
    with pytest.raises(ValueError, match=r"1 <= min_digits <= max_digits <= 12 \(got 4, 3\)"):
        calc_records(1, min_digits=4, max_digits=3)

# ---- the env config -----------------------------------------------------------------------------------------------

def test_env_config_refusals_name_the_field():
    with pytest.raises(ValueError, match=r"env.max_turns must be >= 1.*\(got 0\)"):
        run_of(*TOOLS_ENV, "env.max_turns=0")
    with pytest.raises(ConfigError, match="unknown key env.tool "):
        run_of("env.tool=[calc]")
    [problem] = tool_problems(run_of(*TOOLS_ENV, "env.tools=[calc, abacus]").env)  # msrl validate: preflight
    assert re.fullmatch(r"env.tools: 'abacus' is not a registered tool; registered: .*'calc'.*", problem), problem
    assert tool_problems(run_of(*TOOLS_ENV).env) == [] == tool_problems(run_of("env.tools=[abacus]").env)
    with pytest.raises(ConfigError, match=r"data.template = 'plain' with env.kind = 'tools'.*set data.template: chat"):
        validate(run_of("env.kind=tools"), 1, cuda=False)
    validate(run_of(*TOOLS_ENV, "rollout.kv.policy=snapkv"), 1, cuda=False)  # sparse KV follows turns
    with pytest.raises(ConfigError, match=r"rollout.prefix_caching = true cannot run with rollout.kv.policy"):
        run_of(*TOOLS_ENV, "rollout.kv.policy=snapkv", "rollout.prefix_caching=true")
    validate(run_of(*TOOLS_ENV, "algorithm.old_logprobs=engine_mean"), 1, cuda=False)  # re-scores each episode
    # episodes on rollout ranks, synchronous and k = 2 steps ahead (weights loaded inside a turn)
    validate(run_of(*TOOLS_ENV, "launch.nproc_per_node=2", "launch.rollout_ranks=1"), 2, cuda=False)
    validate(run_of(*TOOLS_ENV, "launch.nproc_per_node=2", "launch.rollout_ranks=1", "trainer.max_staleness=2"), 2,
             cuda=False)
    with pytest.raises(ConfigError, match=r"trainer.max_staleness = 1 samples on the rollout ranks .*needs the "
                                          r"disaggregated placement"):
        validate(run_of(*TOOLS_ENV, "trainer.max_staleness=1"), 1, cuda=False)
    with pytest.raises(ConfigError, match=r"routing.engine_routes = 'vllm' .*cannot run with env.kind = 'tools'"):
        validate(run_of(*TOOLS_ENV, "routing.mode=R3", "routing.engine_routes=vllm"), 1, cuda=False)
    with pytest.raises(ConfigError, match=r"routing.indexer_replay = 'R3' .*cannot run with env.kind = 'tools'"):
        validate(run_of(*TOOLS_ENV, "routing.indexer_replay=R3"), 1, cuda=True)
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens \+ env.max_total_tokens = 256 \+ 96 must be <="):
        validate(run_of(*TOOLS_ENV, "rollout.max_model_len=300"), 1, cuda=False)
    validate(run_of(*TOOLS_ENV), 1, cuda=False)
    validate(run_of("env.tools=[abacus]"), 1, cuda=False)  # kind none: no environment, nothing to refuse


def test_msrl_validate_refuses_zero_turns(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["validate", "configs/tiny_moe.yaml", "--set", *TOOLS_ENV, "env.max_turns=0"]) == 2
    assert "env.max_turns must be >= 1" in capsys.readouterr().err
    assert cli.main(["validate", "configs/tool_calc.yaml", "--set", "env.tools=[calc,abacus]"]) == 2
    assert "env.tools: 'abacus' is not a registered tool" in capsys.readouterr().err


# ---- the episode runner and the loss mask ---------------------------------------------------------------------------

class ScriptedEngine:
    """Gives each call's i-th prompt the next scripted turn text (one token per character); records the prompts."""

    pad_id, weight_version = 0, 3

    def __init__(self, tok, turns: list[list[str]]):
        self.tok, self.turns, self.calls = tok, turns, []

    def sample_turns(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        texts = self.turns[len(self.calls) - 1]
        out = []
        for text, s in zip(texts, sampling):
            ids = self.tok(text, add_special_tokens=False)["input_ids"][:s.max_tokens]
            out.append(SampledTurn(ids, [-0.5] * len(ids), "stop", cached_tokens=0))
        return out


def test_episode_sequence_and_loss_mask_equal_a_hand_built_one(tok):
    sample = Example(prompt="q: 12*3=\na: ", answer="36", ids=tuple(tok("q: 12*3=\na: ")["input_ids"]))
    engine = ScriptedEngine(tok, [["calc(12*3)\n", "7\n"], ["36\n"]])
    env = EnvConfig(kind="tools", max_turns=3, max_total_tokens=40)
    batch = run_episodes(engine, tok, [sample], SamplingConfig(n=2, max_tokens=16, seed=5), env,
                         environment_factory(env, tok))
    assert tok.decode(batch.response_ids[0][batch.response_mask[0]]) == "calc(12*3)\nr: 36\na: 36\n"
    hand = [True] * len("calc(12*3)\n") + [False] * len("r: 36\na: ") + [True] * len("36\n")
    assert batch.loss_mask[0].tolist() == hand
    assert batch.loss_mask[1].tolist() == [True, True] + [False] * (len(hand) - 2)
    assert batch.reward.tolist() == [1.0, 0.0] and batch.finish_reasons == ("stop", "stop")
    assert (batch.rollout_logprobs[batch.loss_mask] == -0.5).all()
    assert (batch.rollout_logprobs[~batch.loss_mask] == 0).all() and (batch.token_version == 3).all()
    second_prompt = engine.calls[1][0][0]
    assert tok.decode(second_prompt) == "<bos>q: 12*3=\na: calc(12*3)\nr: 36\na: "
    assert [s.seed for s in engine.calls[0][1]] == [5, 6] and engine.calls[1][1][0].seed == 5 + 2
    ep = batch.episode_stats
    assert (ep["turns"], ep["tool_calls"], ep["tool_errors"], ep["turn1/tool_calls"], ep["turn2/tokens"]) == \
        (3, 1, 0, 1, 3)
    assert ep["reprefill_tokens"] == len(sample.ids) + len("calc(12*3)\n")  # no prefix cache: all of it again
    # the learner's mask: model tokens only, in the shifted layout (column t scores token t + 1)
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    mask, lp = view.loss_mask, view.rollout_logprobs
    p = len(sample.ids)
    want = torch.zeros_like(mask)
    want[0, p - 1:p - 1 + len(hand)] = torch.tensor(hand)
    want[1, p - 1:p + 1] = True
    assert torch.equal(mask, want) and (lp[mask] == -0.5).all()


def test_episode_limits_end_unrewarded(tok):
    sample = Example(prompt="q: 1=\na: ", answer="1", ids=tuple(tok("q: 1=\na: ")["input_ids"]))
    env = EnvConfig(kind="tools", max_turns=2, max_total_tokens=100)
    engine = ScriptedEngine(tok, [["calc(1+1)\n"], ["calc(1+1)\n"]])
    batch = run_episodes(engine, tok, [sample], SamplingConfig(n=1, max_tokens=16), env, environment_factory(env, tok))
    assert batch.finish_reasons == ("length",) and batch.reward.tolist() == [0.0] and len(engine.calls) == 2
    short = EnvConfig(kind="tools", max_turns=3, max_total_tokens=14)
    engine = ScriptedEngine(tok, [["calc(1+1)\n"]])
    batch = run_episodes(engine, tok, [sample], SamplingConfig(n=1, max_tokens=16), short,
                         environment_factory(short, tok))
    assert engine.calls[0][1][0].max_tokens == 14 and batch.response_lens.tolist() == [10]
    assert batch.finish_reasons == ("length",) and len(engine.calls) == 1  # "r: 2\na: " would pass 14 tokens


def test_loss_mask_outside_the_response_is_refused():
    kw = dict(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_lens=torch.tensor([2]),
              response_ids=torch.ones(1, 3, dtype=torch.long), response_mask=torch.tensor([[True, True, False]]),
              rollout_logprobs=torch.zeros(1, 3), finish_reasons=("stop",), group_ids=torch.tensor([0]))
    RolloutBatch(**kw, loss_mask=torch.tensor([[True, False, False]]))
    with pytest.raises(ValueError, match="loss_mask must be bool"):
        RolloutBatch(**kw, loss_mask=torch.tensor([[True, False, True]]))


def test_token_versions_follow_the_turns_and_an_observation_takes_the_next_turns(tok):
    """Asynchronous RL: turn 1 spans an in-flight update (versions 3 then 4), version 5 is loaded between the turns;
    the observation is prefilled by turn 2, so it carries 5 like turn 2's tokens (hand-built row)."""
    import dataclasses

    class Versioned(ScriptedEngine):
        def sample_turns(self, prompts, sampling):
            turns = super().sample_turns(prompts, sampling)
            if len(self.calls) == 1:
                self.weight_version = 5  # loaded after turn 1 returned
                return [dataclasses.replace(t, token_version=[3] * 4 + [4] * (len(t.token_ids) - 4)) for t in turns]
            return [dataclasses.replace(t, token_version=[5] * len(t.token_ids)) for t in turns]

    sample = Example(prompt="q: 12*3=\na: ", answer="36", ids=tuple(tok("q: 12*3=\na: ")["input_ids"]))
    engine = Versioned(tok, [["calc(12*3)\n"], ["36\n"]])
    env = EnvConfig(kind="tools", max_turns=3, max_total_tokens=40)
    batch = run_episodes(engine, tok, [sample], SamplingConfig(n=1, max_tokens=16), env, environment_factory(env, tok))
    turn1, obs, turn2 = len("calc(12*3)\n"), len("r: 36\na: "), len("36\n")
    assert batch.token_version[0].tolist() == [3] * 4 + [4] * (turn1 - 4) + [5] * (obs + turn2)


def test_collect_episodes_rewards_and_judges_the_final_answer(tok):
    from megatron_sparse_rl.placement.rollout import collect_episodes

    sample = Example(prompt="q: 12*3=\na: ", answer="36", ids=tuple(tok("q: 12*3=\na: ")["input_ids"]))
    engine = ScriptedEngine(tok, [["calc(12*3)\n", "36\n", "calc(1+1)\n"], ["36\n", "35\n"]])
    env = EnvConfig(kind="tools", max_turns=2, max_total_tokens=60)

    def exact(texts, answers):
        return [float(t.strip() == a) for t, a in zip(texts, answers)]

    batch, right = collect_episodes(engine, tok, [sample], SamplingConfig(n=3, max_tokens=16), env, seed=1,
                                    score=exact, correct=exact)
    assert batch.reward.tolist() == [1.0, 1.0, 0.0] and right.tolist() == [1.0, 1.0, 0.0]
    assert batch.finish_reasons == ("stop", "stop", "stop") and batch.episode_stats["turn2/episodes"] == 2


def test_k1_before_and_after_the_tool_by_hand():
    from megatron_sparse_rl.training.update import tool_split_metrics

    # prompt [1, 2]; response: model 10, 11 | env 20, 21 | model 12 (row 0); model 13 only (row 1, no tool)
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[1, 2], [1, 2]]), prompt_lens=torch.tensor([2, 2]),
        response_ids=torch.tensor([[10, 11, 20, 21, 12], [13, 0, 0, 0, 0]]),
        response_mask=torch.tensor([[True] * 5, [True] + [False] * 4]),
        rollout_logprobs=torch.tensor([[-1.0, -2.0, 0.0, 0.0, -3.0], [-0.5, 0.0, 0.0, 0.0, 0.0]]),
        finish_reasons=("stop", "stop"), group_ids=torch.tensor([0, 0]),
        loss_mask=torch.tensor([[True, True, False, False, True], [True] + [False] * 4]))
    view = LearnerBatch.from_rollout(batch, pad_id=0)
    assert view.loss_mask.tolist() == [[False, True, True, False, False, True], [False, True, False, False, False, False]]
    assert view.env_tokens.tolist() == [[False, False, False, True, True, False], [False] * 6]
    mu = torch.tensor([[0.0, -1.0, -2.0, 0.0, 0.0, -3.0], [0.0, -0.5, 0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(view.rollout_logprobs, mu)
    old = torch.tensor([[0.0, -1.1, -2.3, -9.0, -9.0, -2.0], [0.0, -0.4, 0.0, 0.0, 0.0, 0.0]])
    m = tool_split_metrics(view, old)
    # k1 = mean(mu - pi_old): before the tool tokens 10, 11 (row 0) and 13 (row 1); after it token 12 only
    assert m["mismatch/k1_before_tool"] == pytest.approx((0.1 + 0.3 - 0.1) / 3, abs=1e-6)
    assert m["mismatch/k1_after_tool"] == pytest.approx(-1.0, abs=1e-6)


def test_a_demonstrated_episode_trains_the_model_turns_and_matches_the_episode_layout(tmp_path, tok):
    from megatron_sparse_rl.data.templates import encode_sft

    (record,) = calc_records(1, seed=7)
    question, product = record["messages"][0]["content"], record["answer"]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (prompt,) = read_jsonl(path, "messages")
    assert prompt.messages == (("user", question),) and [r for r, _ in prompt.demo] == ["assistant", "tool", "assistant"]
    (ex,), _ = encode_prompts([prompt], tok, DataConfig(source="jsonl", path=str(path), prompt_key="messages",
                                                        template="chat"))
    sft = encode_sft(tok, ex)
    call = f"calc({question.rstrip('=')})\n"
    assert tok.decode(sft.input_ids) == f"<bos>q: {question}\na: {call}r: {product}\na: {product}\n"
    hand = [0] * len(ex.ids) + [1] * len(call) + [0] * len(f"r: {product}\na: ") + [1] * len(product + "\n")
    assert list(sft.loss_mask) == hand
    # the episode a model following the demonstration would sample lays out the same tokens and the same mask
    env = EnvConfig(kind="tools")
    batch = run_episodes(ScriptedEngine(tok, [[call], [product + "\n"]]), tok, [ex], SamplingConfig(n=1, max_tokens=24),
                         env, environment_factory(env, tok))
    assert batch.prompts()[0] + batch.responses()[0] == list(sft.input_ids)
    assert [0] * len(ex.ids) + batch.loss_mask[0].int().tolist() == hand and batch.reward.tolist() == [1.0]
