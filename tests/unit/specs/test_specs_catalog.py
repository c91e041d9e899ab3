"""Spec models, ids, the catalog and its selection, settings parsing."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dsa_aot import settings
from dsa_aot.specs.catalog import load_catalog, select
from dsa_aot.specs.models import KernelSpec, TileConfig


def test_spec_id_round_trip_and_canonical_json():
    spec = KernelSpec(op="bwd", arch="sm_90a", d_qk=576, heads=64, layout="compact")
    assert spec.id == "bwd-sm_90a-d576-h64-compact-tilelang"
    assert KernelSpec.from_id(spec.id) == spec
    assert spec.canonical_json() == KernelSpec.model_validate_json(spec.canonical_json()).canonical_json()


def test_tuned_tile_changes_id():
    base = KernelSpec(op="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact")
    tuned = base.model_copy(update={"tile": TileConfig(block_i=32)})
    assert tuned.id != base.id and tuned.id.startswith(base.id + "-t")


@pytest.mark.parametrize("field,value,fragment", [
    ("d_qk", 128, "d_qk=128"), ("heads", 48, "heads=48"), ("arch", "sm_80", "arch"),
    ("layout", "ragged", "layout"), ("op", "both", "op")])
def test_unsupported_spec_is_rejected_with_the_value(field, value, fragment):
    kwargs = dict(op="fwd", arch="sm_90a", d_qk=576, heads=64, layout="compact")
    kwargs[field] = value
    with pytest.raises(ValidationError, match=fragment):
        KernelSpec(**kwargs)


def test_default_catalog_is_the_full_matrix():
    every = [s for s in load_catalog().specs() if s.backend != "cudnn"]  # cudnn: tests/unit/backends/cudnn
    specs = [s for s in every if not s.deterministic]
    per_op = 2 * 2 * 4 * 2  # arch x d_qk x heads x layout
    assert len(specs) == per_op * 4  # fwd and bwd, each tilelang and cutedsl
    # the cutedsl bwd of sm_90a, -det ids: the stored-rows default and the fixed-point flavours
    deterministic = [s for s in every if s.deterministic and s.tile.flavour is None]
    assert len(deterministic) == per_op // 2 and len({s.id for s in deterministic}) == per_op // 2
    assert {(s.op, s.arch, s.backend) for s in deterministic} == {("bwd", "sm_90a", "cutedsl")}
    assert all(s.id.endswith("-det") and KernelSpec.from_id(s.id) == s for s in deterministic)
    fixed = [s for s in every if s.deterministic and s.tile.flavour is not None]
    assert {(s.heads, s.tile.flavour) for s in fixed} == {
        (16, "wgmma_ws_slot_major_fixed"), (32, "wgmma_ws_slot_major_fixed"),
        (64, "wgmma_ws_fixed"), (128, "wgmma_ws_fixed")}
    assert len({s.id for s in fixed}) == per_op // 2  # ids of their own (a tile hash, -det-t...)
    assert all("-det-t" in s.id for s in fixed)
    assert len({s.id for s in specs}) == len(specs)
    assert {s.arch for s in specs} == {"sm_90a", "sm_100a"}
    by_backend = {(op, b): sum(s.op == op and s.backend == b for s in specs)
                  for op in ("fwd", "bwd") for b in ("tilelang", "cutedsl")}
    assert set(by_backend.values()) == {per_op}
    assert load_catalog().ranking == {"fwd": ["cutedsl", "tilelang"], "bwd": ["cudnn", "cutedsl", "tilelang"]}
    narrowed = load_catalog().specs({("tilelang", "fwd")})  # (backend, op) pairs to keep
    assert len(narrowed) == per_op and {(s.backend, s.op) for s in narrowed} == {("tilelang", "fwd")}


def test_select_only_arch_and_shards_partition():
    specs = load_catalog().specs()
    assert all(s.op == "fwd" and s.arch == "sm_90a" for s in select(specs, only=["fwd-sm_90a-*"]))
    shards = [select(specs, shard=(i, 3)) for i in (1, 2, 3)]
    assert sorted(s.id for sh in shards for s in sh) == sorted(s.id for s in specs)
    assert select(specs, archs=["sm_100a"]) == [s for s in specs if s.arch == "sm_100a"]


def test_user_catalog(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[[matrix]]\nops=["fwd"]\narchs=["sm_90a"]\nd_qk=[576]\nheads=[64]\nlayouts=["compact"]\n'
                    '[matrix.tile]\nblock_i=32\n')
    specs = load_catalog(path).specs()
    assert [s.tile.block_i for s in specs] == [32]
    path.write_text('[[matrix]]\nops=["fwd"]\narchs=["sm_90a"]\nd_qk=[100]\nheads=[64]\nlayouts=["compact"]\n')
    with pytest.raises(ValidationError, match="d_qk=100"):
        load_catalog(path).specs()


def test_settings_parse_and_errors(monkeypatch):
    monkeypatch.setenv("DSA_AOT_JIT", "0")
    monkeypatch.setenv("DSA_AOT_ARCH_LIST", "sm_90a,sm_100a")
    monkeypatch.setenv("DSA_AOT_CACHE_MAX_BYTES", "2G")
    cfg = settings.Settings.from_env()
    assert (cfg.jit, cfg.arch_list, cfg.cache_max_bytes) == (False, ("sm_90a", "sm_100a"), 2 << 30)
    monkeypatch.setenv("DSA_AOT_JIT", "maybe")
    with pytest.raises(settings.SettingsError, match="DSA_AOT_JIT='maybe'"):
        settings.Settings.from_env()
    monkeypatch.setenv("DSA_AOT_JIT", "1")
    monkeypatch.setenv("DSA_AOT_ARCH_LIST", "sm_80")
    with pytest.raises(settings.SettingsError, match="sm_80"):
        settings.Settings.from_env()


def test_settings_scope_restores():
    before = settings.get()
    with settings.scope(jit=False) as cfg:
        assert cfg.jit is False and settings.get().jit is False
    assert settings.get() == before
    with pytest.raises(TypeError, match="unknown settings"):
        with settings.scope(nope=1):
            pass


def test_ranking_alone_matches_full_catalog(tmp_path):
    from dsa_aot.specs.catalog import load_catalog, load_ranking

    assert load_ranking() == {k: list(v) for k, v in load_catalog().ranking.items()}
    bad = tmp_path / "bad.toml"
    for table, fragment in (('fwd = ["triton"]', "triton"), ('sideways = ["tilelang"]', "sideways"),
                            ('fwd = "tilelang"', "tilelang")):
        bad.write_text(f"[[matrix]]\nops=['fwd']\narchs=['sm_90a']\nd_qk=[576]\nheads=[64]\n"
                       f"layouts=['compact']\n[ranking]\n{table}\n")
        with pytest.raises(ValueError, match=fragment):
            load_ranking(bad)
        with pytest.raises(ValueError):
            load_catalog(bad)


def test_preferences_alone_match_full_catalog_and_bad_tables_are_refused(tmp_path):
    from dsa_aot.specs.catalog import load_catalog, load_preferences

    assert load_preferences() == [r.model_dump(exclude_none=True) for r in load_catalog().prefer]
    bad = tmp_path / "bad.toml"
    for table, fragment in (('archs = ["sm_90a"]', "needs backends"),
                            ('backends = ["triton"]', "triton"),
                            ('heads = 16\nbackends = ["cutedsl"]', "heads = 16"),
                            ('heads = [true]\nbackends = ["cutedsl"]', "heads"),
                            ('shapes = [1]\nbackends = ["cutedsl"]', "unknown field 'shapes'"),
                            ('ops = []\nbackends = ["cutedsl"]', "ops = \\[\\]")):
        bad.write_text("[[matrix]]\nops=['fwd']\narchs=['sm_90a']\nd_qk=[576]\nheads=[64]\n"
                       f"layouts=['compact']\n[[prefer]]\n{table}\n")
        with pytest.raises(ValueError, match=fragment):
            load_preferences(bad)
        with pytest.raises(ValueError):
            load_catalog(bad)


def test_the_first_matching_preference_wins_over_the_ranking():
    from dsa_aot.specs.catalog import ranked

    ranking = {"bwd": ["cudnn", "cutedsl", "tilelang"], "fwd": ["cutedsl", "tilelang"]}
    rules = [{"ops": ["bwd"], "archs": ["sm_90a"], "d_qk": [512], "backends": ["cutedsl", "cudnn"]},
             {"heads": [16, 32], "backends": ["tilelang"]},
             {"ops": ["bwd"], "backends": ["cutedsl"]}]
    assert ranked(ranking, rules, "bwd", "sm_90a", 512, 16) == ["cutedsl", "cudnn"]
    assert ranked(ranking, rules, "bwd", "sm_100a", 512, 16) == ["tilelang"]
    assert ranked(ranking, rules, "fwd", "sm_90a", 576, 64) == ["cutedsl", "tilelang"]
    assert ranked(ranking, rules, "bwd", "sm_100a", 576, 64) == ["cutedsl"]
    assert ranked(ranking, [], "bwd", "sm_90a", 512, 16) == ["cudnn", "cutedsl", "tilelang"]


def test_packaged_catalog_puts_the_faster_sm90_backward_first():
    """bench/results/h200_bwd.md: ours ahead at D512 and at H16/H32, cuDNN's at D576 H64/H128."""
    from dsa_aot.specs.catalog import load_preferences, load_ranking, ranked

    ranking, rules = load_ranking(), load_preferences()
    for d_qk, heads in ((512, 16), (512, 64), (512, 128), (576, 16), (576, 32)):
        assert ranked(ranking, rules, "bwd", "sm_90a", d_qk, heads)[0] == "cutedsl"
    for d_qk, heads in ((576, 64), (576, 128)):
        assert ranked(ranking, rules, "bwd", "sm_90a", d_qk, heads)[0] == "cudnn"
    assert ranked(ranking, rules, "bwd", "sm_100a", 512, 16)[0] == "cudnn"


def test_ranking_tables_are_remembered_per_catalog_file(tmp_path, monkeypatch):
    """The serving path's tables: equal to the parsed ones, reused by a later process without
    parsing, and read again once the catalog file changes."""
    import shutil

    from dsa_aot import settings
    from dsa_aot.specs import installed, ranking

    catalog = tmp_path / "catalog.toml"
    shutil.copy(ranking.default_catalog_path(), catalog)
    monkeypatch.setattr(ranking, "default_catalog_path", lambda: catalog)
    monkeypatch.setenv("DSA_AOT_CACHE_DIR", str(tmp_path / "cache"))
    settings.reload()
    installed._memo_cache = None
    try:
        parsed = (ranking.load_ranking(catalog), ranking.load_preferences(catalog), ranking.load_topk_buckets(catalog))
        assert ranking.ranking_tables() == parsed
        installed._memo_cache = None  # as a fresh process
        monkeypatch.setattr(ranking, "_read", lambda path: pytest.fail("parsed the catalog"))
        assert ranking.ranking_tables() == parsed
        monkeypatch.undo()
        monkeypatch.setattr(ranking, "default_catalog_path", lambda: catalog)
        text = catalog.read_text()
        assert parsed[0]["fwd"] == ["cutedsl", "tilelang"] and 'fwd = ["cutedsl", "tilelang"]' in text
        catalog.write_text(text.replace('fwd = ["cutedsl", "tilelang"]', 'fwd = ["tilelang", "cutedsl"]', 1))
        assert ranking.ranking_tables()[0]["fwd"] == ["tilelang", "cutedsl"]
    finally:
        monkeypatch.undo()
        settings.reload()
        installed._memo_cache = None
