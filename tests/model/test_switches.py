"""A DSA attention call's switches (backend, deterministic mode, guard policy): from the config,
environment variables as overrides, megatron-core's dsa_kernel_backend refused with its meaning."""

from types import SimpleNamespace

import pytest
import torch

from glm5_dsa_plugin.model.switches import apply_guard_policy, describe, resolve_switches
from glm5_dsa_plugin.ops import configure, guard_policy
from megatron_cpu import megatron_single_process  # noqa: F401


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("GLM5_DSA_BACKEND", raising=False)
    monkeypatch.delenv("GLM5_DSA_NONFINITE", raising=False)
    yield monkeypatch
    configure(policy="fallback")


def test_switches_come_from_the_config_and_the_environment_overrides(clean_env):
    s = resolve_switches(None)
    assert (s.backend, s.deterministic, s.guard_policy) == ("auto", False, "fallback")
    cfg = SimpleNamespace(dsa_sparse_mla_backend="reference", deterministic_mode=True, dsa_nonfinite_policy="raise")
    s = resolve_switches(cfg)
    assert (s.backend, s.deterministic, s.guard_policy) == ("reference", True, "raise")
    assert s.sources == {"backend": "config.dsa_sparse_mla_backend", "deterministic": "config.deterministic_mode",
                         "guard_policy": "config.dsa_nonfinite_policy"}
    assert describe(s)[0].split() == ["backend", "reference", "(config.dsa_sparse_mla_backend)"]
    apply_guard_policy(s)
    assert guard_policy() == "raise"  # the config set the process-wide guard policy
    clean_env.setenv("GLM5_DSA_BACKEND", "tilelang")
    clean_env.setenv("GLM5_DSA_NONFINITE", "OFF")
    configure(policy="fallback")
    s = resolve_switches(cfg)
    assert (s.backend, s.guard_policy) == ("tilelang", "off")
    assert s.sources["backend"] == "$GLM5_DSA_BACKEND" and s.sources["guard_policy"] == "$GLM5_DSA_NONFINITE"
    apply_guard_policy(s)
    assert guard_policy() == "fallback"  # an override is the guard's own setting: not re-applied from here


def test_bad_switch_values_name_the_field_or_variable(clean_env):
    with pytest.raises(ValueError, match=r"config.dsa_sparse_mla_backend='fast': expected 'auto' or a registered"):
        resolve_switches(SimpleNamespace(dsa_sparse_mla_backend="fast"))
    with pytest.raises(ValueError, match=r"config.dsa_nonfinite_policy='maybe': expected one of"):
        resolve_switches(SimpleNamespace(dsa_nonfinite_policy="maybe"))
    clean_env.setenv("GLM5_DSA_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"GLM5_DSA_BACKEND='fast'"):
        resolve_switches(None)


def _run(model, card, B=2, S=16):
    tok = torch.randint(0, card["vocab_size"], (B, S))
    labels = torch.randint(0, card["vocab_size"], (B, S))
    return model(tok, torch.arange(S)[None].expand(B, S), None, labels=labels)


def test_config_backend_reaches_sparse_mla(megatron_single_process, clean_env, no_deterministic_backend):
    """config.dsa_sparse_mla_backend selects the backend of every DSA attention call;
    GLM5_DSA_BACKEND overrides it; a backend assigned to the module in code overrides both."""
    import glm5_dsa_plugin.model.attention as attention
    from tiny_models import build, tiny_config

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["backend"])
        return attention_sparse_mla(*args, **kwargs)

    attention_sparse_mla = attention.sparse_mla
    clean_env.setattr(attention, "sparse_mla", spy)
    card, cfg = tiny_config()
    cfg.dsa_sparse_mla_backend = no_deterministic_backend
    model = build(cfg, card)
    with torch.no_grad():
        _run(model, card)
    assert seen and set(seen) == {no_deterministic_backend}
    atts = [m for m in model.modules() if isinstance(m, attention.GLM5DSAttention)]
    assert all(a.backend == no_deterministic_backend for a in atts)
    atts[0].backend = "reference"  # pinned in code: this module only
    seen.clear()
    with torch.no_grad():
        _run(model, card)
    assert seen == ["reference"] + [no_deterministic_backend] * (len(atts) - 1)
    clean_env.setenv("GLM5_DSA_BACKEND", "reference")
    seen.clear()
    with torch.no_grad():
        _run(build(cfg, card), card)
    assert seen and set(seen) == {"reference"}


def test_launcher_backend_flag_sets_the_config(megatron_single_process, clean_env):
    from glm5_dsa_plugin.model.attention import GLM5DSAttention
    from glm5_dsa_plugin.train import core

    args = core.base_parser("t").parse_args(["--card", "tiny", "--backend", "reference", "--device", "cpu"])
    card = core.load_card_from_args(args)
    cfg = core.model_config(args, card, mtp_num_layers=None)
    assert cfg.dsa_sparse_mla_backend == "reference"
    model = core.build_model(args, card, cfg)
    atts = [m for m in model.modules() if isinstance(m, GLM5DSAttention)]
    assert atts and all(a.backend == "reference" and a.switches.sources["backend"] == "config.dsa_sparse_mla_backend"
                        for a in atts)


def test_megatron_core_kernel_backend_refusal_names_our_switch(megatron_single_process, clean_env):
    from tiny_models import build, tiny_config

    for value in ("tilelang", "cudnn"):
        card, cfg = tiny_config()
        cfg.dsa_kernel_backend = value  # (megatron-core checks its packages at config creation: set after)
        with pytest.raises(ValueError, match=rf"dsa_kernel_backend='{value}' is not supported: it selects "
                                             r"megatron-core's fused DSA kernels.*config.dsa_sparse_mla_backend"):
            build(cfg, card, mtp=False)
    card, cfg = tiny_config()
    cfg.dsa_kernel_backend = "none"
    build(cfg, card, mtp=False)  # megatron-core's default: accepted


def test_config_guard_policy_is_applied_when_the_model_is_built(megatron_single_process, clean_env):
    from tiny_models import build, tiny_config

    card, cfg = tiny_config()
    cfg.dsa_nonfinite_policy = "raise"
    build(cfg, card, mtp=False)
    assert guard_policy() == "raise"
    cfg.dsa_nonfinite_policy = "sometimes"
    with pytest.raises(ValueError, match=r"config.dsa_nonfinite_policy='sometimes'"):
        build(cfg, card, mtp=False)


def test_doctor_prints_the_resolved_switches(clean_env, capsys):
    from glm5_dsa_plugin.__main__ import _main

    clean_env.setenv("GLM5_DSA_BACKEND", "reference")
    assert _main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "call switches" in out
    assert any(line.split() == ["backend", "reference", "($GLM5_DSA_BACKEND)"] for line in out.splitlines()), out
    assert any(line.split()[:2] == ["guard_policy", "fallback"] for line in out.splitlines()), out
