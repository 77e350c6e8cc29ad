"""Multi-turn episodes on the rollout engine: sample a model turn for every running episode, let each episode's
environment answer, append its observation, and sample again, until every episode is done.

    batch = run_episodes(engine, tokenizer, examples, sampling, env_cfg, make_env)

Every example gives `sampling.n` episodes (group id = the example's index, or `group_ids`). Each turn is one
`RolloutEngine.sample_turns` call over the running episodes, the whole episode so far as the prompt; with
`rollout.prefix_caching` vLLM reuses the full KV blocks an earlier turn computed, otherwise it prefills the whole
history again. What it prefilled again is measured (`episode/reprefill_tokens`).

The batch: `prompt_ids` is the first observation (the example's prompt); `response_ids` everything after it, model
turns and environment tokens in order; `response_mask` all of them; `loss_mask` the model's tokens only;
`rollout_logprobs` the model tokens' logprobs (0 on environment tokens); `reward` the sum of the episode's step
rewards; `finish_reasons` "stop" when the environment ended the episode, "length" when `env.max_turns` or
`env.max_total_tokens` did; `token_version` the weight version that sampled each model token (weights loaded during
a turn: `between_steps`) and, for an observation's tokens (out of the loss), the version of the turn that prefilled
them (the next one). `episode_stats` holds the sums of `EPISODE_KEYS` and, per turn k (1-based),
`turn{k}/episodes`, `turn{k}/tokens` (model tokens), `turn{k}/tool_calls`, `turn{k}/tool_errors`. A text observation
is encoded as text (`split_special_tokens`): a special-token string an environment or a tool wrote ("<eos>",
"<|im_end|>") stays characters, so it can neither end the episode nor fake a turn of the chat template.
With R3 route capture on the engine (rollout/routes.py `turn_fields`) `features.routed_experts` holds the routes of
every input position of each row (prompt + response, less its last token): each position routed by the turn that first
computed it. With the sampling-mask record (rollout/sampling_mask.py) `features.sampling_mask` holds the sampler's
support at every response token (count 0, the full vocabulary, on the environment's). With sparse KV
(kv/engine_extension.py) `features.kv_keep` holds one KVKeepRecord per row, every turn's compactions merged
(kv/record.py `next_turn`); a turn's request prefills the whole history densely, so the history's tokens and the
environment's attend causally. An episode always ends with a model turn, so its last records cover the whole row.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.rollout import SamplingConfig
from megatron_sparse_rl.envs.base import Environment, Observation
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError, token_hash
from megatron_sparse_rl.rollout.batch import FeatureRecords, RolloutBatch, pad_rows
from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport

EPISODE_KEYS = ("episodes", "turns", "model_tokens", "env_tokens", "tool_calls", "tool_errors", "tool_timeouts",
                "prefill_tokens", "reprefill_tokens", "cached_tokens")
"""The batch-wide sums in `RolloutBatch.episode_stats` (besides the per-turn ones)."""
TURN_KEYS = ("episodes", "tokens", "tool_calls", "tool_errors")
"""The sums kept per turn k as `turn{k}/<key>` (k = 1 .. env.max_turns)."""


@dataclass
class _Episode:
    """One running episode: its environment, its sequence so far and what was counted."""

    env: Environment
    group: int
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)  # per response token: the model's (True) or the environment's
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    finish: str = "length"
    records: dict = field(default_factory=dict)  # the engine extensions' record of the sequence so far
    versions: list[int] = field(default_factory=list)  # per response token; -1: an observation not prefilled yet

    def extend(self, ids: Sequence[int], logprobs: Sequence[float] | None, versions: Sequence[int] = ()) -> None:
        """Model tokens (`logprobs` and the `versions` that sampled them) or, `logprobs` None, an observation (its
        version is set by the turn that prefills it: `prefilled_by`)."""
        self.response += list(ids)
        self.loss_mask += [logprobs is not None] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += list(versions) if logprobs is not None else [-1] * len(ids)

    def prefilled_by(self, version: int) -> None:
        """The observation that ends the response is prefilled by the next turn, at weight version `version`."""
        n = len(self.versions)
        while n and self.versions[n - 1] == -1:
            n -= 1
            self.versions[n] = version


def _ids(tokenizer, obs: Observation) -> list[int]:
    """An observation's token ids: as given, or the text encoded as text (none added, none read from it)."""
    if not isinstance(obs, str):
        return list(obs)
    return list(tokenizer(obs, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _turn_sampling(sampling: SamplingConfig, env: EnvConfig, seed_offset: int, left: int) -> SamplingConfig:
    seed = None if sampling.seed is None else sampling.seed + seed_offset
    return dataclasses.replace(sampling, n=1, seed=seed, max_tokens=min(sampling.max_tokens, left),
                               stop=tuple(dict.fromkeys(sampling.stop + env.turn_stop)))


def _step(e: _Episode, turn, tokenizer, env: EnvConfig, last_turn: bool, stats: dict, version: int) -> None:
    """Append a sampled turn to `e` (its tokens' versions, all `version` when the engine gives none), hand it to the
    environment and append its observation (or end `e`)."""
    e.extend(turn.token_ids, turn.logprobs, turn.token_version or [version] * len(turn.token_ids))
    result = e.env.step(tokenizer.decode(turn.token_ids, skip_special_tokens=True))
    e.reward += float(result.reward)
    stats["tool_calls"] += result.tool_calls
    stats["tool_errors"] += result.tool_errors
    stats["tool_timeouts"] += result.tool_timeouts
    if result.done:
        e.done, e.finish = True, "stop"
        return
    obs = _ids(tokenizer, result.observation)
    if last_turn or len(e.response) + len(obs) >= env.max_total_tokens:
        e.done = True  # out of turns, or no room for the observation and one more model token: unrewarded end
        return
    e.extend(obs, None)
    stats["env_tokens"] += len(obs)


def run_episodes(engine, tokenizer, examples: Sequence, sampling: SamplingConfig, env: EnvConfig,
                 make_env: Callable[[], Environment], group_ids: Sequence[int] | None = None, *,
                 between_steps: Callable[[], None] | None = None) -> RolloutBatch:
    """`sampling.n` episodes per example, run to the end on `engine`; the RolloutBatch described in the module
    docstring. Sampling seeds: episode i's turn t uses sampling.seed + t * (number of episodes) + i.
    `between_steps` runs between the engine steps of every turn (asynchronous RL loads new weights there:
    `RolloutEngine.update_in_flight`)."""
    gids = list(range(len(examples))) if group_ids is None else list(group_ids)
    if len(gids) != len(examples):
        raise ValueError(f"group_ids must have one id per example (got {len(gids)} for {len(examples)})")
    episodes = []
    for example, gid in zip(examples, gids):
        for _ in range(sampling.n):
            e = _Episode(env=make_env(), group=gid, prompt=[])
            e.prompt = _ids(tokenizer, e.env.reset(example))
            episodes.append(e)
    stats = dict.fromkeys(EPISODE_KEYS + tuple(f"turn{t + 1}/{k}" for t in range(env.max_turns)
                                                for k in TURN_KEYS), 0.0)
    stats["episodes"] = float(len(episodes))
    for t in range(env.max_turns):
        live = [(i, e) for i, e in enumerate(episodes) if not e.done]
        if not live:
            break
        params = [_turn_sampling(sampling, env, t * len(episodes) + i, env.max_total_tokens - len(e.response))
                  for i, e in live]
        records, version = [e.records for _, e in live], engine.weight_version
        for _, e in live:
            e.prefilled_by(version)
        turns = engine.sample_turns([e.prompt + e.response for _, e in live], params,
                                    **({"records": records} if any(records) else {}),
                                    **({"between_steps": between_steps} if between_steps is not None else {}))
        for (_, e), turn in zip(live, turns):
            e.records = turn.records
            seen = len(e.prompt) + len(e.response)
            stats["prefill_tokens"] += seen - turn.cached_tokens
            stats["cached_tokens"] += turn.cached_tokens
            if t:  # the history an earlier turn computed, less what the prefix cache gave back
                stats["reprefill_tokens"] += max(0, seen - _trailing_observation(e) - turn.cached_tokens)
            stats["model_tokens"] += len(turn.token_ids)
            stats["turns"] += 1
            before = (stats["tool_calls"], stats["tool_errors"])
            _step(e, turn, tokenizer, env, t == env.max_turns - 1, stats, version)
            if len(e.response) >= env.max_total_tokens:
                e.done = True
            k = f"turn{t + 1}/"
            stats[k + "episodes"] += 1
            stats[k + "tokens"] += len(turn.token_ids)
            stats[k + "tool_calls"] += stats["tool_calls"] - before[0]
            stats[k + "tool_errors"] += stats["tool_errors"] - before[1]
    return _batch(episodes, engine.pad_id, stats)


def _trailing_observation(e: _Episode) -> int:
    """Length of the observation that ends `e`'s response (the environment tokens after its last model token)."""
    n = 0
    while n < len(e.loss_mask) and not e.loss_mask[-1 - n]:
        n += 1
    return n


def _batch(episodes: list[_Episode], pad_id: int, stats: dict[str, float]) -> RolloutBatch:
    responses = [e.response for e in episodes]
    response_ids = pad_rows(responses, pad_id, torch.long)
    lens = torch.tensor([len(r) for r in responses])
    response_mask = torch.arange(response_ids.shape[1])[None, :] < lens[:, None]
    return RolloutBatch(
        prompt_ids=pad_rows([e.prompt for e in episodes], pad_id, torch.long),
        prompt_lens=torch.tensor([len(e.prompt) for e in episodes], dtype=torch.long),
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=pad_rows([e.logprobs for e in episodes], 0.0, torch.float32),
        finish_reasons=tuple(e.finish for e in episodes),
        group_ids=torch.tensor([e.group for e in episodes], dtype=torch.long),
        reward=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
        token_version=pad_rows([e.versions for e in episodes], max(max(e.versions, default=0) for e in episodes),
                               torch.long),
        loss_mask=pad_rows([[float(m) for m in e.loss_mask] for e in episodes], 0.0, torch.float32).bool()
        & response_mask,
        episode_stats=stats,
        features=_features(episodes),
    )


_RECORD_KEYS = ("routed_experts", "sampling_mask", "kv_keep")


def _features(episodes: list[_Episode]) -> FeatureRecords:
    """The batch's feature records from the episodes' last records: `routed_experts` (one route sequence per row),
    `sampling_mask` (the sampler's support at every response token; 0 = the full vocabulary on environment tokens)
    and `kv_keep` (one KVKeepRecord per row, every turn merged: kv/record.py)."""
    keys = {k for e in episodes for k in e.records}
    if keys - set(_RECORD_KEYS):
        raise ValueError(f"episode records {sorted(keys - set(_RECORD_KEYS))} have no FeatureRecords field")
    fields = {}
    if "kv_keep" in keys:
        fields["kv_keep"] = tuple(_kv_keep(i, e) for i, e in enumerate(episodes))
        keys.discard("kv_keep")
    for i, e in enumerate(episodes):
        seq = e.prompt + e.response
        store = e.records.get("routed_experts")
        if "routed_experts" in keys and (store is None or int(store.lengths[0]) != len(seq) - 1
                                         or int(store.token_hash[0]) != token_hash(seq[:-1])):
            raise RoutingError(f"episode {i}: its routes do not cover its {len(seq) - 1} input positions")
        support = e.records.get("sampling_mask")
        if "sampling_mask" in keys and (support is None or int(support.prompt_lens[0]) != len(e.prompt)
                                        or len(support.counts[0]) != len(e.response)):
            raise ValueError(f"episode {i}: its sampling support does not cover its {len(e.response)} response "
                             "tokens")
    return FeatureRecords(**fields, **{k: (RouteStore.concat if k == "routed_experts" else SamplingSupport.concat)(
        [e.records[k] for e in episodes]) for k in sorted(keys)})


def _kv_keep(i: int, e: _Episode):
    """Episode `i`'s merged keep record, which must end where its sequence does (its last turn merged)."""
    record, n = e.records.get("kv_keep"), len(e.prompt) + len(e.response)
    if record is None or not record.turn_ends or record.turn_ends[-1] != n:
        covered = None if record is None else record.turn_ends
        raise ValueError(f"episode {i}: its KV keep record (turn ends {covered}) does not cover its {n} tokens")
    return record


def final_turns(batch: RolloutBatch) -> list[list[int]]:
    """Each row's last model turn (the response tokens after its last environment token; the whole response of a
    row without a loss mask)."""
    out = []
    for i, ids in enumerate(batch.response_ids):
        n = int(batch.response_mask[i].sum())
        env_at = [] if batch.loss_mask is None else (~batch.loss_mask[i, :n]).nonzero().flatten().tolist()
        out.append(ids[(env_at[-1] + 1 if env_at else 0):n].tolist())
    return out
