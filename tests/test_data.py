"""Token files, the mixture dataset and the mixture sampler's stream, weights, ranks and resume."""

from __future__ import annotations

import itertools
import json
import math
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hookloop.engine.data import (
    MixtureDataset,
    MixtureSampler,
    TokenDataset,
    prepare_tokens,
    read_token_metadata,
    stdlib_docs_text,
    stdlib_source_files,
)
from hookloop.engine.data.prepare import main as prepare_main
from hookloop.engine.errors import ConfigError
from tests.dist_utils import run_process

REPO = Path(__file__).resolve().parents[1]


class Items:
    """Map-style dataset whose item ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


def take(iterator, n: int) -> list[int]:
    return list(itertools.islice(iterator, n))


def make_mixture(**lengths: int) -> MixtureDataset:
    return MixtureDataset({name: Items(n) for name, n in lengths.items()})


def write_tokens(path: Path, values, dtype: str, sidecar: bool = True) -> Path:
    np.asarray(values, dtype=dtype).tofile(path)
    if sidecar:
        path.with_name(path.name + ".json").write_text(json.dumps({"dtype": dtype}))
    return path


# ---------------------------------------------------------------------------------- TokenDataset


def test_token_dataset_windows_are_contiguous_and_labels_shifted(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(100), "uint16")
    ds = TokenDataset(path, 8)
    assert len(ds) == 12  # 99 // 8: window 11 ends at token 96, window 12 would need token 104
    for i in (0, 5, 11):
        inputs, labels = ds[i]
        assert inputs.dtype == labels.dtype == torch.int64
        assert inputs.tolist() == list(range(8 * i, 8 * i + 8))
        assert labels.tolist() == list(range(8 * i + 1, 8 * i + 9))
    assert ds[-1][0].tolist() == ds[11][0].tolist()
    with pytest.raises(IndexError):
        ds[12]
    # editing inputs in place must not leak into labels
    inputs, labels = ds[0]
    inputs.zero_()
    assert labels.tolist() == list(range(1, 9))


def test_token_dataset_exact_fit_and_given_dtype(tmp_path):
    path = write_tokens(tmp_path / "t.bin", [70000, 1, 2, 3, 4], "uint32", sidecar=False)
    ds = TokenDataset(path, 4, dtype="uint32")
    assert len(ds) == 1
    assert ds[0][0].tolist() == [70000, 1, 2, 3]
    assert ds[0][1].tolist() == [1, 2, 3, 4]


def test_token_dataset_pickles_without_the_memory_map(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(50), "uint8")
    ds = TokenDataset(path, 7)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._tokens is None
    assert clone[3][1].tolist() == ds[3][1].tolist()


def test_token_dataset_bad_inputs(tmp_path):
    path = write_tokens(tmp_path / "t.bin", np.arange(10), "uint16")
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        TokenDataset(tmp_path / "missing.bin", 4)
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ConfigError, match="seq_len") as info:
            TokenDataset(path, bad)
        assert info.value.field == "seq_len"
    with pytest.raises(ConfigError, match="seq_len.*10 tokens"):
        TokenDataset(path, 10)  # needs 11 tokens
    for bad in ("int16", "float32", "uint64", "nonsense"):
        with pytest.raises(ConfigError, match="dtype"):
            TokenDataset(path, 4, dtype=bad)
    with pytest.raises(ConfigError, match="dtype.*contradicts"):
        TokenDataset(path, 4, dtype="uint8")
    bare = write_tokens(tmp_path / "bare.bin", np.arange(10), "uint8", sidecar=False)
    with pytest.raises(ConfigError, match="dtype") as info:
        TokenDataset(bare, 4)
    assert info.value.field == "dtype"
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="multiple"):
        TokenDataset(odd, 1, dtype="uint16")


# ---------------------------------------------------------------------------------- prepare_tokens


def test_prepare_round_trips_text_bytes(tmp_path):
    doc_file = tmp_path / "doc.txt"
    doc_file.write_text("from a file\nline two\n", encoding="utf-8")
    docs = ["héllo wörld ✓", "second", doc_file]
    out = tmp_path / "out" / "tokens.bin"
    meta = prepare_tokens(docs, out)
    expected = [docs[0].encode(), docs[1].encode(), doc_file.read_bytes()]
    data = out.read_bytes()
    assert data.split(b"\x00") == expected
    assert meta["num_tokens"] == len(data) == sum(map(len, expected)) + 2
    assert meta["num_documents"] == 3
    assert read_token_metadata(out) == meta
    assert not (tmp_path / "out" / "tokens.bin.tmp").exists()
    ds = TokenDataset(out, 4)
    assert bytes(ds[0][0].tolist()) == "héll".encode()[:4]


def test_prepare_wider_dtype_and_separator(tmp_path):
    out = tmp_path / "t16.bin"
    meta = prepare_tokens(["ab", b"\xff"], out, dtype="uint16", separator=256)
    assert meta["dtype"] == "uint16"
    assert np.fromfile(out, dtype="<u2").tolist() == [97, 98, 256, 255]
    single = prepare_tokens("just one", tmp_path / "one.bin")
    assert single["num_documents"] == 1 and (tmp_path / "one.bin").read_bytes() == b"just one"


def test_prepare_bad_inputs(tmp_path):
    out = tmp_path / "x.bin"
    with pytest.raises(ConfigError, match="dtype"):
        prepare_tokens(["a"], out, dtype="int32")
    with pytest.raises(ConfigError, match="separator"):
        prepare_tokens(["a"], out, separator=256)
    with pytest.raises(ConfigError, match="sources"):
        prepare_tokens([], out)
    with pytest.raises(TypeError, match=r"sources\[1\]"):
        prepare_tokens(["a", 5], out)
    with pytest.raises(FileNotFoundError, match=r"sources\[0\]"):
        prepare_tokens([tmp_path / "nope.txt"], out)
    assert not out.exists() and not (tmp_path / "x.bin.tmp").exists()


def test_stdlib_text_sources_need_no_download():
    text = stdlib_docs_text()
    assert len(text) > 100_000 and "assert" in text
    assert text == stdlib_docs_text()
    files = stdlib_source_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    skipped = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    assert not any(skipped & set(f.parts[-4:-1]) for f in files)
    assert "os.py" in {f.name for f in files}
    assert stdlib_source_files(limit=5) == files[:5]
    with pytest.raises(ConfigError, match="limit"):
        stdlib_source_files(limit=-1)


def test_prepare_cli(tmp_path):
    out = tmp_path / "src.bin"
    assert prepare_main(["prepare", str(out), "--from-stdlib-source", "--limit", "3"]) == 0
    files = stdlib_source_files(limit=3)
    assert out.stat().st_size == sum(f.stat().st_size for f in files) + 2
    docs = tmp_path / "docs.bin"
    cmd = [sys.executable, "-m", "hookloop.engine.data", "prepare", str(docs), "--from-stdlib-docs"]
    proc = run_process(cmd, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert docs.read_bytes() == stdlib_docs_text().encode()


# ---------------------------------------------------------------------------------- MixtureDataset


def test_mixture_dataset_indexing():
    pairs = [(torch.tensor([i]), torch.tensor([i + 1])) for i in range(3)]
    mix = MixtureDataset({"a": Items(4), "empty": Items(0), "pairs": pairs, "c": Items(2)})
    assert mix.names == ("a", "empty", "pairs", "c")
    assert mix.offsets == (0, 4, 4, 7)
    assert len(mix) == 9
    assert mix.locate(3) == (0, 3)
    assert mix.locate(4) == (2, 0)
    assert mix.locate(8) == (3, 1)
    assert mix.locate(-1) == (3, 1)
    assert mix.global_index(2, 1) == 5
    assert mix[2] == (2, 0)
    inputs, labels, source = mix[6]
    assert (inputs.item(), labels.item(), source) == (2, 3, 2)
    assert mix[8] == (1, 3)
    for bad in (9, -10):
        with pytest.raises(IndexError):
            mix.locate(bad)
    with pytest.raises(IndexError, match="local_idx"):
        mix.global_index(1, 0)
    with pytest.raises(IndexError, match="source_idx"):
        mix.global_index(4, 0)


def test_mixture_dataset_bad_inputs():
    with pytest.raises(TypeError, match="datasets"):
        MixtureDataset([Items(2)])
    with pytest.raises(ConfigError, match="datasets"):
        MixtureDataset({})
    with pytest.raises(TypeError, match=r"datasets\['gen'\]"):
        MixtureDataset({"gen": iter(range(3))})


# ---------------------------------------------------------------------------------- MixtureSampler: weights


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 3.0])
def test_temperature_matches_closed_form(temperature):
    weights = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 0.25}
    sampler = MixtureSampler(make_mixture(a=10, b=10, c=10, d=10), weights, temperature=temperature)
    powered = {k: w ** (1 / temperature) for k, w in weights.items()}
    total = sum(powered.values())
    for name, p in sampler.probabilities.items():
        assert p == pytest.approx(powered[name] / total, rel=1e-12, abs=0)
    assert sum(sampler.probabilities.values()) == pytest.approx(1.0, abs=1e-15)


def test_extreme_temperature_does_not_overflow():
    sampler = MixtureSampler(make_mixture(a=5, b=5), {"a": 1e300, "b": 1e-300}, temperature=0.01)
    assert sampler.probabilities == {"a": 1.0, "b": 0.0}
    sampler.update_weights({"a": 1e300, "b": 1e-300}, temperature=1e6)
    probs = sampler.probabilities
    assert probs["a"] == pytest.approx(0.5, abs=1e-3) and probs["b"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("temperature", [0.1, 10.0])
def test_zero_weight_stays_exactly_zero(temperature):
    mix = make_mixture(z0=50, a=50, z1=50, b=50, z2=50)
    weights = {"z0": 0, "a": 1e-6, "z1": 0.0, "b": 1.0, "z2": 0}
    sampler = MixtureSampler(mix, weights, temperature=temperature)
    probs = sampler.probabilities
    assert probs["z0"] == probs["z1"] == probs["z2"] == 0.0
    assert probs["a"] > 0
    sources = {mix.locate(i)[0] for i in take(iter(sampler), 100_000)}
    assert sources <= {1, 3}
    assert sampler.consumed_per_source()["z1"] == 0


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_empirical_proportions_match_probabilities(temperature):
    mix = make_mixture(a=997, b=1009, c=3, d=50_000)
    sampler = MixtureSampler(mix, {"a": 1.0, "b": 2.0, "c": 0.5, "d": 6.5}, temperature=temperature, seed=7)
    n = 200_000
    counts = np.bincount([mix.locate(i)[0] for i in take(iter(sampler), n)], minlength=4)
    for count, p in zip(counts, sampler.probabilities.values()):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(count - n * p) <= 5 * sigma, (count, n * p, sigma)
    assert list(sampler.consumed_per_source().values()) == counts.tolist()


def test_update_weights_applies_to_the_next_index():
    mix = make_mixture(a=100, b=100, c=100)
    sampler = MixtureSampler(mix, {"a": 1, "b": 1, "c": 1})
    it = iter(sampler)
    take(it, 37)
    sampler.update_weights({"a": 0, "b": 1, "c": 0})
    assert {mix.locate(i)[0] for i in take(it, 300)} == {1}
    sampler.update_weights({"a": 0, "b": 0, "c": 2}, temperature=0.3)
    assert sampler.temperature == 0.3
    assert mix.locate(next(it))[0] == 2


def test_source_order_is_independent_of_weight_changes():
    """Each source walks through its own epochs: a weight change neither repeats nor skips items."""
    mix = make_mixture(a=500, b=120, c=7)

    def per_source_order(changes: bool) -> dict[int, list[int]]:
        sampler = MixtureSampler(mix, {"a": 1, "b": 1, "c": 1}, seed=3)
        it = iter(sampler)
        order: dict[int, list[int]] = {0: [], 1: [], 2: []}
        schedule = itertools.cycle(
            [{"a": 5, "b": 1, "c": 0}, {"a": 0, "b": 1, "c": 1}, {"a": 1, "b": 3, "c": 1}]
        )
        while min(len(order[0]), len(order[1]), len(order[2])) < 1000:
            if changes:
                sampler.update_weights(next(schedule))
            for index in take(it, 37):
                source, local = mix.locate(index)
                order[source].append(local)
        return {s: v[:1000] for s, v in order.items()}

    changed = per_source_order(changes=True)
    assert changed == per_source_order(changes=False)
    for source, length in enumerate(mix.lengths):
        seq = changed[source]
        for start in range(0, len(seq) - length + 1, length):
            assert sorted(seq[start : start + length]) == list(range(length))
        assert seq[:length] != seq[length : 2 * length]  # each epoch has its own permutation


def test_every_epoch_gets_a_fresh_permutation():
    big, tiny = 4096, 3
    mix = make_mixture(big=big, tiny=tiny)
    only_big = MixtureSampler(mix, {"big": 1, "tiny": 0}, seed=2)
    seq = take(iter(only_big), 3 * big)
    epochs = [seq[e * big : (e + 1) * big] for e in range(3)]
    assert all(sorted(epoch) == list(range(big)) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert epochs[0] != list(range(big))

    only_tiny = MixtureSampler(mix, {"big": 0, "tiny": 1}, seed=2)
    local = [i - big for i in take(iter(only_tiny), 6000)]  # 2000 epochs of 3
    perms = [tuple(local[e * tiny : (e + 1) * tiny]) for e in range(2000)]
    assert all(sorted(p) == [0, 1, 2] for p in perms)
    assert len(set(perms)) == 6  # all orderings of 3 items occur
    assert perms[:600] != perms[1365:1965]  # epochs drawn from different generators differ


# ---------------------------------------------------------------------------------- MixtureSampler: resume


def mixture_for_resume() -> MixtureDataset:
    return make_mixture(big=100_000, mid=777, tiny=5)


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 2)])
@pytest.mark.parametrize("point", [0, 1, 1023, 1024, 6000, 70_001])
def test_resume_gives_identical_next_1000(point, world_size, rank):
    mix = mixture_for_resume()
    weights = {"big": 1.0, "mid": 2.0, "tiny": 0.5}
    live = MixtureSampler(mix, weights, seed=11, rank=rank, world_size=world_size)
    it = iter(live)
    take(it, point)
    snapshot = json.loads(json.dumps(live.state_dict()))  # must survive a JSON round trip
    expected = take(it, 1000)
    restored = MixtureSampler(mix, {"big": 1, "mid": 0, "tiny": 0}, seed=0, rank=rank, world_size=world_size)
    restored.load_state_dict(snapshot)
    assert take(iter(restored), 1000) == expected
    assert snapshot["draws"] == point * world_size


@pytest.mark.parametrize("snapshot_after", [0, 777])
def test_resume_across_weight_updates(snapshot_after):
    mix = mixture_for_resume()
    w1, w2, w3 = (
        {"big": 1, "mid": 1, "tiny": 1},
        {"big": 0, "mid": 3, "tiny": 1},
        {"big": 2, "mid": 0, "tiny": 5},
    )
    live = MixtureSampler(mix, w1, seed=5)
    it = iter(live)
    take(it, 3001)
    live.update_weights(w2, temperature=0.5)
    take(it, snapshot_after)
    snapshot = live.state_dict()
    expected = take(it, 500)
    live.update_weights(w3)
    expected += take(it, 500)

    restored = MixtureSampler(mix, w1, seed=5)
    restored.load_state_dict(snapshot)
    assert restored.probabilities == pytest.approx({"big": 0.0, "mid": 0.9, "tiny": 0.1})
    rit = iter(restored)
    got = take(rit, 500)
    restored.update_weights(w3)
    got += take(rit, 500)
    assert got == expected
    assert restored.consumed_per_source() == live.consumed_per_source()


def test_new_iterator_continues_the_stream():
    mix = make_mixture(a=30, b=40)
    reference = take(iter(MixtureSampler(mix, {"a": 1, "b": 1})), 40)
    sampler = MixtureSampler(mix, {"a": 1, "b": 1})
    first = iter(sampler)
    got = take(first, 15)
    second = iter(sampler)
    got += take(second, 25)
    assert got == reference
    assert take(first, 5) == []  # superseded iterators end


def test_state_dict_rejects_other_mixtures():
    sampler = MixtureSampler(make_mixture(a=10, b=10), {"a": 1, "b": 1})
    state = sampler.state_dict()
    with pytest.raises(ConfigError, match="sources"):
        MixtureSampler(make_mixture(a=10, c=10), {"a": 1, "c": 1}).load_state_dict(state)
    with pytest.raises(ConfigError, match="length"):
        MixtureSampler(make_mixture(a=10, b=11), {"a": 1, "b": 1}).load_state_dict(state)
    with pytest.raises(ConfigError, match="format"):
        sampler.load_state_dict({**state, "version": 99})
    with pytest.raises(ConfigError, match="draws"):
        sampler.load_state_dict({**state, "draws": 5})


# ---------------------------------------------------------------------------------- MixtureSampler: ranks


def test_ranks_are_disjoint_and_union_is_the_single_rank_stream():
    mix = make_mixture(a=50_000, b=30_000, c=20_000)
    weights, later = {"a": 1, "b": 1, "c": 2}, {"a": 3, "b": 0, "c": 1}
    world = 3

    def stream(rank: int, world_size: int, before: int, after: int) -> list[int]:
        sampler = MixtureSampler(mix, weights, seed=9, rank=rank, world_size=world_size)
        it = iter(sampler)
        out = take(it, before)
        sampler.update_weights(later)  # every rank changes weights after the same number of yields
        return out + take(it, after)

    per_rank = [stream(r, world, 2000, 3000) for r in range(world)]
    single = stream(0, 1, 2000 * world, 3000 * world)
    interleaved = [index for round_ in zip(*per_rank) for index in round_]
    assert interleaved == single
    sets = [set(s) for s in per_rank]
    assert all(len(s) == 5000 for s in sets)  # no source wraps an epoch in 15000 draws
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])


def test_ranks_stay_disjoint_when_small_sources_wrap():
    mix = make_mixture(a=11, b=5)
    samplers = [MixtureSampler(mix, {"a": 1, "b": 1}, rank=r, world_size=2) for r in range(2)]
    streams = [take(iter(s), 4000) for s in samplers]
    draws: dict[int, list[int]] = {0: [], 1: []}
    for pair in zip(*streams):
        for index in pair:
            source, local = mix.locate(index)
            draws[source].append(local)
    for source, length in enumerate(mix.lengths):  # every epoch of every source is one permutation
        seq = draws[source]
        for start in range(0, len(seq) - length + 1, length):
            assert sorted(seq[start : start + length]) == list(range(length))
    total = samplers[0].consumed_per_source(all_ranks=True)
    assert total == {"a": len(draws[0]), "b": len(draws[1])}
    assert samplers[0].draws == samplers[1].draws == 8000


def test_resume_on_a_different_world_size_continues_the_global_stream():
    mix = make_mixture(a=1000, b=1000)
    single = take(iter(MixtureSampler(mix, {"a": 1, "b": 2})), 1000)
    pair = [MixtureSampler(mix, {"a": 1, "b": 2}, rank=r, world_size=2) for r in range(2)]
    firsts = [take(iter(s), 200) for s in pair]
    resumed = MixtureSampler(mix, {"a": 1, "b": 1})
    resumed.load_state_dict(pair[1].state_dict())
    assert [i for rnd in zip(*firsts) for i in rnd] + take(iter(resumed), 600) == single


# ---------------------------------------------------------------------------------- MixtureSampler: errors


def test_sampler_is_endless():
    sampler = MixtureSampler(make_mixture(a=3), {"a": 1})
    with pytest.raises(TypeError, match="endless"):
        len(sampler)
    assert len(take(iter(sampler), 100)) == 100


@pytest.mark.parametrize(
    "weights,match",
    [
        ({"a": -1, "b": 1, "empty": 0}, r"weights\['a'\].*>= 0"),
        ({"a": float("nan"), "b": 1, "empty": 0}, r"weights\['a'\].*finite"),
        ({"a": 1, "b": float("inf"), "empty": 0}, r"weights\['b'\].*finite"),
        ({"a": 0, "b": 0.0, "empty": 0}, "all zero"),
        ({"a": 1, "b": 1, "empty": 0, "zz": 1}, r"unknown.*'zz'"),
        ({"a": 1, "empty": 0}, r"no weight.*'b'"),
        ({"a": 1, "b": 1, "empty": 1}, r"weights\['empty'\].*empty"),
    ],
)
def test_bad_weights_raise_naming_the_dataset(weights, match):
    mix = make_mixture(a=5, b=5, empty=0)
    with pytest.raises(ValueError, match=match):
        MixtureSampler(mix, weights)
    sampler = MixtureSampler(mix, {"a": 1, "b": 3, "empty": 0})
    it = iter(sampler)
    take(it, 10)
    before = sampler.state_dict()
    with pytest.raises(ValueError, match=match):
        sampler.update_weights(weights)
    assert sampler.state_dict() == before  # a rejected update changes nothing


def test_bad_sampler_arguments_raise_naming_them():
    mix = make_mixture(a=5)
    cases = [
        ({"temperature": 0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1}, "rank"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ConfigError, match=field) as info:
            MixtureSampler(mix, {"a": 1}, **kwargs)
        assert info.value.field == field
    with pytest.raises(TypeError, match="weights"):
        MixtureSampler(mix, [1.0])
    with pytest.raises(TypeError, match=r"weights\['a'\]"):
        MixtureSampler(mix, {"a": "1"})
    with pytest.raises(TypeError, match="mixture"):
        MixtureSampler({"a": Items(5)}, {"a": 1})
    with pytest.raises(ConfigError, match="temperature"):
        MixtureSampler(mix, {"a": 1}).update_weights({"a": 1}, temperature=0.0)


# ---------------------------------------------------------------------------------- end to end


def test_dataloader_over_token_mixture(tmp_path):
    prepare_tokens(["a" * 300], tmp_path / "a.bin")
    prepare_tokens(["b" * 300], tmp_path / "b.bin", dtype="uint16")
    mix = MixtureDataset(
        {"a": TokenDataset(tmp_path / "a.bin", 16), "b": TokenDataset(tmp_path / "b.bin", 16)}
    )
    sampler = MixtureSampler(mix, {"a": 1, "b": 3}, seed=1)
    loader = DataLoader(mix, batch_size=8, sampler=sampler)
    inputs, labels, sources = next(iter(loader))
    assert inputs.shape == labels.shape == (8, 16)
    assert sources.dtype == torch.int64
    for row, source in zip(inputs.tolist(), sources.tolist()):
        assert set(row) == {ord("ab"[source])}
    assert sum(sampler.consumed_per_source().values()) == 8
