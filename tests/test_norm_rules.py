"""What the classifier calls a norm: a module that returns its input normalised."""


def test_an_inverse_rms_statistic_is_no_norm_block(parse_model):
    """HY V4's hyper-connections scale a projection by input_norm(x), a module that returns
    rsqrt(mean(x^2) + eps) of shape [..., 1]: it was a norm.rms block served by the rmsnorm
    template (coverage: template), and align then rejected the patch (output (1, 64, 512) for
    the original's (1, 64, 1)) for model.hc_head.input_norm (onboard run hf:hy_v4_vl)."""
    g = parse_model("tests/fixtures/row_statistic_models.py:row_statistic")
    norms = {b.path for b in g.blocks if b.kind.startswith("norm.")}
    assert not any(p.endswith("input_norm") for p in norms), norms
    # the real norms are still norms
    assert {"layers.0.norm", "layers.1.norm", "norm"} <= norms
