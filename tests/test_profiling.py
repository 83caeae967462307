"""jaxspec.tools.profiling: the compiled program's instructions by category and source, and the bytes a
decode step must read, against references written out here."""
# ruff: noqa: E501  (HLO lines are written as XLA prints them)

import jaxspec
from jaxspec.tools import profiling

HLO = """HloModule jit_step

%fused_computation (param_0: f32[1,64], param_1: f32[64,256]) -> f32[1,256] {
  %param_0 = f32[1,64]{1,0} parameter(0)
  %param_1 = f32[64,256]{1,0} parameter(1)
  ROOT %dot.7 = f32[1,256]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_transpose (param_0: f32[1,64], param_1: f32[256,64]) -> f32[256,1] {
  %param_0 = f32[1,64]{1,0} parameter(0)
  %param_1 = f32[256,64]{1,0} parameter(1)
  %dot.9 = f32[256,1]{1,0} dot(%param_1, %param_0), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %transpose.10 = f32[1,256]{0,1} transpose(%dot.9), dimensions={1,0}
}

%body.1 (p: (s32[], f32[1,64])) -> (s32[], f32[1,64]) {
  %p = (s32[], f32[1,64]) parameter(0)
  %gemm_fusion = f32[1,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(run_on_device)/while/body/lm_head/md,vd->mv/dot_general"}
  %dynamic-update-slice.3 = f32[2,8,2,16]{3,2,1,0} dynamic-update-slice(%c, %d, %i, %j), metadata={op_name="jit(run_on_device)/while/body/scatter"}
  %add_fusion.2 = f32[1,64]{1,0} fusion(%e, %f), kind=kLoop, calls=%fused_add
  %fusion.8 = f32[256,1]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_transpose, metadata={op_name="jit(run_on_device)/while/body/gate_up_fxd/transpose"}
  ROOT %tuple.4 = (s32[], f32[1,64]) tuple(%g, %h)
}

ENTRY %main.9 (x: f32[1,64]) -> f32[1,64] {
  %x = f32[1,64]{1,0} parameter(0)
  %while.5 = (s32[], f32[1,64]) while(%t), condition=%cond.1, body=%body.1
  ROOT %copy.6 = f32[1,64]{1,0} copy(%y)
}
"""


def test_hlo_instructions_by_category_and_source():
    ops = profiling.hlo_instructions(HLO)
    # A kernel's inner dot has no metadata of its own: it takes the fusion that calls it.
    assert ops["dot.7"] == ("matmul", "lm_head/md,vd->mv/dot_general", "f32[1,256]")
    assert ops["gemm_fusion"][0] == "matmul"
    assert ops["dynamic-update-slice.3"][:2] == ("cache write / scatter", "scatter")
    assert ops["add_fusion.2"][0] == "elementwise fusion"
    assert ops["fusion.8"][:2] == ("matmul", "gate_up_fxd/transpose")   # a dot with its transpose, by what it calls
    assert ops["while.5"][0] == ops["tuple.4"][0] == "control"
    assert ops["copy.6"][0] == "copy"


def test_step_bytes_counts_weights_read_and_the_live_cache():
    cfg = jaxspec.ModelConfig(vocab_size=300, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                              intermediate_size=96, max_position_embeddings=512, tie_word_embeddings=False)
    d, f, v, h = 64, 96, 300, 16
    matrices = cfg.num_layers * (d * 4 * h + 2 * d * 2 * h + 4 * h * d + 3 * d * f) + d * v   # blocks + LM head
    vectors = cfg.num_layers * 2 * d + d                                                        # norms
    model = jaxspec.Model.random(cfg)
    got = profiling.step_bytes(model, batch=3, context=50)
    assert got == {"weights": 4 * (matrices + vectors), "kv_cache": 3 * 50 * 2 * 3 * 2 * h * 4}
    scales = cfg.num_layers * (4 * h + 2 * 2 * h + d + 2 * f + d) + v    # one per output channel
    assert profiling.step_bytes(model.quantize("int8"), 3, 50)["weights"] == matrices + 4 * (scales + vectors)
    tied = jaxspec.Model.random(cfg.replace(tie_word_embeddings=True))   # the embedding is then the head
    assert profiling.step_bytes(tied, 1, 1)["weights"] == 4 * (matrices + vectors)


def test_kernels_fall_into_the_parts_of_a_step():
    part = profiling.component
    assert part("matmul", "", "f32[4,300]", 300) == "LM head"            # as wide as the vocabulary
    assert part("matmul", "lm_head/transpose", "f32[300,4]", 300) == "LM head"
    assert part("matmul", "gate_up_fxd/transpose", "f32[192,4]", 300) == "projections"
    assert part("matmul", "attention/closed_call/dot_general", "f32[4,64]", 300) == "attention"
    assert part("cache write / scatter", "closed_call/scatter", "f32[2,8]", 300) == "cache write"
    assert part("elementwise fusion", "closed_call/greedy_accept/reduce", "s32[4]", 300) == "sampling / acceptance"
    assert part("elementwise fusion", "closed_call/rsqrt", "f32[4,64]", 300) == "other"
