"""The one "at or inside" rule for dotted module paths (onboarding.modpath)."""

from onboarding.modpath import inside, related


def test_inside_is_at_or_below_on_dot_boundaries():
    assert inside("model.layers.0.mlp", "model.layers.0")
    assert inside("model.layers.0", "model.layers.0")
    assert not inside("model.layers.01", "model.layers.0")  # a sibling that shares a prefix
    assert not inside("model.layers", "model.layers.0")     # the parent is not inside its child
    assert inside("model.layers.0", "") and inside("", "")  # the model itself holds every module
    assert not inside("", "model")


def test_related_is_either_way():
    assert related("a.b", "a") and related("a", "a.b") and related("a", "a")
    assert not related("a.b", "a.c") and not related("ab", "a")
    assert related("", "a.b")
