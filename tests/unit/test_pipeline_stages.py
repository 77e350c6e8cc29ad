"""Uneven pipeline stages (config/stages.py): balanced splits where parallel.pp does not divide the layer count,
parallel.pipeline_layout parsed by Megatron-Core's own parser into layers per stage, and the refusals of bad layouts
at config load and at `validate`, each naming the field. The learner running them: tests/distributed/
test_uneven_pipeline.py."""
from __future__ import annotations

import pytest

from megatron_sparse_rl.config import ConfigError
from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.config.stages import PipelineStages, balanced, pipeline_stages
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.validation.summary import run_summary
from tests.unit.test_config_validate import run_of


@pytest.mark.parametrize("layers,pp,want", [(7, 3, (3, 2, 2)), (61, 8, (8, 8, 8, 8, 8, 7, 7, 7)), (8, 2, (4, 4)),
                                            (94, 16, (6,) * 14 + (5,) * 2), (5, 5, (1,) * 5)])
def test_balanced_split(layers, pp, want):
    assert balanced(layers, pp) == want and sum(want) == layers
    stages = pipeline_stages(pp, layers)
    assert stages.layers == want and not stages.explicit


def test_megatron_setting_and_offsets():
    auto = pipeline_stages(3, 7)
    assert auto.megatron_kwargs() == {"pipeline_model_parallel_layout": "Ettt|tt|ttL"}
    assert [auto.offset(p) for p in range(3)] == [0, 3, 5]
    assert auto.describe() == "stages 3,2,2 (balanced, automatic)"
    assert pipeline_stages(2, 8).megatron_kwargs() == {}  # even: Megatron's own default split
    assert pipeline_stages(1, 7).megatron_kwargs() == {}
    written = pipeline_stages(3, 7, "Ett|ttt|ttL")
    assert written == PipelineStages((2, 3, 2), explicit=True)
    assert written.describe() == "stages 2,3,2 (parallel.pipeline_layout)"
    # Megatron's repeat syntax; DeepSeek-V3's 61 layers at pp 8
    assert pipeline_stages(8, 61, "Et*8|(t*8|)*6t*5L").layers == (8,) * 7 + (5,)


def test_offsets_are_megatron_get_transformer_layer_offset():
    """The layout string we hand Megatron puts each stage where our offsets say (its own offset function)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    for pp, layers in ((3, 7), (8, 61), (4, 10)):
        stages = pipeline_stages(pp, layers)
        parsed = PipelineParallelLayerLayout(stages.layout(), pp)
        parsed.validate_layer_layout(layers, None)
        assert [parsed.get_layer_offset(pp_rank=p) for p in range(pp)] == [stages.offset(p) for p in range(pp)]


@pytest.mark.parametrize("layout,pp,message", [
    ("Ett|tt|ttL", 3, "places 6 decoder layers ('t'), the model has 7: the layout must cover every layer once"),
    ("Etttt|tttL", 3, "has 2 stages, parallel.pp=3"),
    ("Et|t|t|t|t|ttL", 3, "for interleaved virtual stages set parallel.vpp=2"),
    ("Ettt|ttm|ttL", 3, "puts multi-token-prediction layers ('m') on stage 1, before the last stage (2)"),
    ("Ettt|tt|ttmL", 3, "the learner builds none"),
    ("tttE|tt|ttL", 3, "must start with the embedding 'E' and end with the loss 'L'"),
    ("Ettttttt||L", 3, "leaves stage 1 without a decoder layer"),
])
def test_bad_layouts_are_refused_naming_the_field(layout, pp, message):
    with pytest.raises(ValueError, match="parallel.pipeline_layout") as e:
        pipeline_stages(pp, 7, layout)
    assert message in str(e.value)


def test_config_load_refusals():
    with pytest.raises(ValueError, match=r"parallel.pipeline_layout needs parallel.pp > 1 \(got pp=1\)"):
        ParallelConfig(pipeline_layout="EttL")
    with pytest.raises(ValueError, match=r"parallel.pipeline_layout has characters \['x'\]"):
        ParallelConfig(pp=2, pipeline_layout="Ettx|tL")
    with pytest.raises(ValueError, match=r"parallel.pp=8 exceeds the layer count \(7\)"):
        pipeline_stages(8, 7)


def test_validate_accepts_uneven_pp_and_names_the_split():
    run = run_of("model.tiny.layers=7", "parallel.pp=3", "launch.nproc_per_node=3")
    spec = validate(run, 3, cuda=False)
    assert any("pp 3 x dp 1" in line and "pipeline stages 3,2,2 (balanced, automatic) of 7 layers" in line
               for line in run_summary(run, spec, 3))
    written = run_of("model.tiny.layers=7", "parallel.pp=3", "parallel.pipeline_layout='Ett|ttt|ttL'",
                     "launch.nproc_per_node=3")
    assert any("pipeline stages 2,3,2 (parallel.pipeline_layout)" in line
               for line in run_summary(written, validate(written, 3, cuda=False), 3))


def test_validate_refuses_a_layout_that_misses_layers():
    run = run_of("model.tiny.layers=7", "parallel.pp=3", "parallel.pipeline_layout='Ett|tt|ttL'",
                 "launch.nproc_per_node=3")
    with pytest.raises(ConfigError, match=r"parallel.pipeline_layout = 'Ett\|tt\|ttL' places 6 decoder layers"):
        validate(run, 3, cuda=False)


def test_start_line_names_the_split(caplog, tmp_path):
    """`msrl train`'s start line (trainer.py `_announce`) names the pipeline split at pp > 1."""
    import logging
    from types import SimpleNamespace

    from megatron_sparse_rl import trainer
    from megatron_sparse_rl.config.degrees import ParallelDegrees

    run = run_of("model.tiny.layers=7", "parallel.pp=3", "launch.nproc_per_node=3")
    spec = validate(run, 3, cuda=False)
    ctx = SimpleNamespace(is_main=True, layout=ParallelDegrees.from_config(run.parallel, 3, cuda=False), run=run,
                          spec=spec, owner=SimpleNamespace(run_id="0123456789"), run_dir=tmp_path,
                          learner=SimpleNamespace(lora_params={}))
    with caplog.at_level(logging.INFO, logger=trainer.__name__):
        trainer._announce(ctx, trainer.state.LoopState())
    assert "learner TP1 PP3 EP1 DP1 (pipeline stages 3,2,2 (balanced, automatic))" in caplog.text


# ---- interleaved pipelines (parallel.vpp) ------------------------------------------------------------------------

def test_virtual_stages_balanced_in_layer_order_and_megatron_agrees(monkeypatch):
    """7 layers at pp 2 x vpp 2 -> virtual stages 2,2,2,1; rank 0 holds virtual stages 0 and 2, rank 1 stages 1
    and 3; Megatron-Core's own layout class puts each chunk's first layer where our offsets say."""
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    stages = pipeline_stages(2, 7, vpp=2)
    assert stages == PipelineStages((2, 2, 2, 1), vpp=2) and stages.pp == 2
    assert stages.chunks(0) == (0, 2) and stages.chunks(1) == (1, 3)
    assert stages.megatron_kwargs() == {"pipeline_model_parallel_layout": "Ett|tt|tt|tL"}
    assert stages.describe() == "virtual stages 2,2,2,1 (pp 2 x vpp 2; balanced, automatic)"
    assert pipeline_stages(2, 8, vpp=2).megatron_kwargs() == {"pipeline_model_parallel_layout": "Ett|tt|tt|ttL"}
    for pp, vpp, layers in ((2, 2, 7), (3, 2, 10), (2, 3, 13), (4, 2, 61)):
        stages = pipeline_stages(pp, layers, vpp=vpp)
        parsed = PipelineParallelLayerLayout(stages.layout(), pp)
        parsed.validate_layer_layout(layers, None)
        assert parsed.virtual_pipeline_model_parallel_size == vpp
        # its offsets read the chunk (vp_stage) only when parallel_state says the pipeline is interleaved
        monkeypatch.setattr(parallel_state, "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", vpp)
        for p in range(pp):
            for chunk, v in enumerate(stages.chunks(p)):
                assert parsed.get_layer_offset(vp_stage=chunk, pp_rank=p) == stages.offset(v)
                assert parsed.get_num_layers_to_build(vp_stage=chunk, pp_rank=p) == stages.layers[v]
    written = pipeline_stages(2, 7, "Et|ttt|tt|tL", vpp=2)
    assert written.layers == (1, 3, 2, 1) and written.explicit
    assert written.describe() == "virtual stages 1,3,2,1 (pp 2 x vpp 2; parallel.pipeline_layout)"


@pytest.mark.parametrize("pp,vpp,layout,message", [
    (1, 2, None, "parallel.vpp=2 needs parallel.pp > 1 (got pp=1)"),
    (2, 2, "Ett|tt|tttL", "has 3 stages, parallel.pp * parallel.vpp = 2 * 2 = 4"),
    (2, 2, "Ett|tttL", "has 2 stages, parallel.pp * parallel.vpp = 2 * 2 = 4"),
    (2, 4, None, "parallel.pp * parallel.vpp = 2 * 4 = 8 exceeds the layer count (7)"),
    (2, 2, "Ett|tt|tt|ttL", "places 8 decoder layers ('t'), the model has 7"),
])
def test_bad_interleaved_layouts_are_refused_naming_the_field(pp, vpp, layout, message):
    with pytest.raises(ValueError, match=r"parallel\.(vpp|pp|pipeline_layout)") as e:
        pipeline_stages(pp, 7, layout, vpp=vpp)
    assert message in str(e.value)


def test_vpp_refused_at_config_load_and_validate():
    with pytest.raises(ValueError, match=r"parallel.vpp=2 needs parallel.pp > 1 \(got pp=1\)"):
        ParallelConfig(vpp=2)
    with pytest.raises(ValueError, match=r"parallel.vpp must be >= 1 \(got 0\)"):
        ParallelConfig(pp=2, vpp=0)
    ok = run_of("model.tiny.layers=7", "parallel.pp=2", "parallel.vpp=2", "launch.nproc_per_node=2",
                "learner.micro_batch_size=2")
    assert any("pipeline virtual stages 2,2,2,1 (pp 2 x vpp 2; balanced, automatic) of 7 layers" in line
               for line in run_summary(ok, validate(ok, 2, cuda=False), 2))
    # 16 prompts x 4 samples = 64 rows: micro-batches of 3 do not divide them; of 32, 2 micro-batches at pp 4 ...
    for extra, world in ((("learner.micro_batch_size=3",), 2), (("learner.micro_batch_size=32", "parallel.pp=4"), 4)):
        run = run_of("model.tiny.layers=7", "parallel.pp=2", "parallel.vpp=2", f"launch.nproc_per_node={world}",
                     *extra)
        with pytest.raises(ConfigError, match=r"parallel.vpp=2: each update's rows per data-parallel rank .* must "
                                              r"split into micro-batches of learner.micro_batch_size=\d+ whose count "
                                              r"is a multiple of parallel.pp="):
            validate(run, world, cuda=False)
    sft = run_of("model.tiny.layers=7", "parallel.pp=2", "parallel.vpp=2", "launch.nproc_per_node=2",
                 "learner.micro_batch_size=4", "trainer.sft.max_steps=1", "trainer.sft.batch_size=4")
    with pytest.raises(ConfigError, match=r"the SFT warm-start's rows per data-parallel rank \(trainer.sft.batch_size "
                                          r"/ dp = 4 / 1\) must split"):
        validate(sft, 2, cuda=False)
    dsa = run_of("model.tiny.layers=7", "parallel.pp=2", "parallel.vpp=2", "launch.nproc_per_node=2",
                 "learner.micro_batch_size=2", "model.dsa_indexer_loss_coeff=0.1")
    with pytest.raises(ConfigError, match=r"model.dsa_indexer_loss_coeff = 0.1 need parallel.vpp = 1"):
        validate(dsa, 2, cuda=False)
    cp = run_of("model.tiny.layers=7", "parallel.pp=2", "parallel.vpp=2", "parallel.cp=2", "launch.nproc_per_node=4",
                "learner.micro_batch_size=2")
    validate(cp, 4, cuda=False)  # the interleaved schedule at cp > 1 (tests/distributed/test_context_parallel.py)
    bad = run_of("model.tiny.layers=7", "parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout='Ett|tt|tttL'",
                 "launch.nproc_per_node=2", "learner.micro_batch_size=2")
    with pytest.raises(ConfigError, match=r"parallel.pipeline_layout = 'Ett\|tt\|tttL' has 3 stages"):
        validate(bad, 2, cuda=False)


@pytest.mark.parametrize("rows, mbs, pp, vpp, want", [
    (1, 4, 2, 2, (2, 1)),     # the weight-sync probe's one row: two micro-batches of it, one of them padding
    (3, 2, 2, 2, (2, 2)),     # one padding row
    (5, 4, 2, 1, (2, 3)),     # equal micro-batches of at most 4 rows
    (16, 4, 2, 2, (4, 4)),    # a batch that already splits keeps its split
    (8, 4, 4, 2, (4, 2)),
    (2, 4, 2, 1, (1, 2)),
])
def test_pipeline_split_of_forward_only_calls(rows, mbs, pp, vpp, want):
    from megatron_sparse_rl.learner.chunks import pipeline_split

    count, size = pipeline_split(rows, mbs, pp, vpp)
    assert (count, size) == want
    assert 0 <= count * size - rows < count and size <= mbs and (vpp == 1 or count % pp == 0)  # < 1 pad row each


def _split(*sizes, pad=0):
    """Micro-batches of the given row counts, the last one with `pad` padding rows: (row index, real rows) each."""
    out, start = [], 0
    for i, size in enumerate(sizes):
        out.append((list(range(start, start + size)), size - (pad if i == len(sizes) - 1 else 0)))
        start += size
    return out


@pytest.mark.parametrize("batches, pp, vpp, recorded, refused", [
    (_split(2, 2), 2, 1, False, None),
    (_split(2, 1), 2, 1, False, "equal micro-batches"),             # stages exchange one activation shape
    (_split(2, 1), 1, 1, False, None),                               # one stage: any split
    (_split(2, 2, 2), 2, 2, False, "a multiple of parallel.pp=2"),   # interleaved: groups of pp
    (_split(2, 2, 2, 2), 2, 2, False, None),
    (_split(2, 2, pad=1), 2, 1, True, "would need padding rows"),    # routes are recorded per real row
    (_split(2, 2, pad=1), 2, 1, False, None),
])
def test_micro_batches_the_schedule_runs(batches, pp, vpp, recorded, refused):
    from types import SimpleNamespace

    from megatron_sparse_rl.learner.chunks import check_micro_batches

    layout = SimpleNamespace(pp=pp, vpp=vpp)
    rows = sum(real for _, real in batches)
    if refused is None:
        assert check_micro_batches(batches, rows=rows, layout=layout, micro_batch_size=2, recorded=recorded) == 2
    else:
        with pytest.raises(ValueError, match=refused):
            check_micro_batches(batches, rows=rows, layout=layout, micro_batch_size=2, recorded=recorded)


def test_pipeline_refuses_unequal_training_micro_batches():
    """pp > 1 without interleaving still needs equal micro-batches (stages exchange one activation shape): 16 prompts
    x 4 samples = 64 rows in micro-batches of 3 are refused at validate, naming the fields; one micro-batch of all
    64 (micro_batch_size 128) runs."""
    run = run_of("model.tiny.layers=7", "parallel.pp=2", "launch.nproc_per_node=2", "learner.micro_batch_size=3")
    with pytest.raises(ConfigError, match=r"parallel.pp=2: each update's rows per data-parallel rank \(trainer."
                                          r"prompts_per_step \* rollout.sampling.n / dp / trainer.updates_per_rollout = "
                                          r"16 \* 4 / 1 / 1\) must split into equal micro-batches of "
                                          r"learner.micro_batch_size=3"):
        validate(run, 2, cuda=False)
    validate(run_of("model.tiny.layers=7", "parallel.pp=2", "launch.nproc_per_node=2", "learner.micro_batch_size=128"),
             2, cuda=False)
