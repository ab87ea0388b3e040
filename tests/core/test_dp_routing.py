"""The data-parallel router's policy (core/dp_routing.py), driven with plain keys."""

from __future__ import annotations

import pytest

from vlmserve.core.dp_routing import AffinityRouter, RouteKey
from vlmserve.multimodal.inputs import MultiModalFeature

BS = 4


def chat(conv: int, turns: int, images: int = 2) -> RouteKey:
    """A chat's prompt after `turns` turns: its images (8 rows each, its own) first, then 12
    tokens a turn; each turn's prompt extends the one before."""
    feats = [MultiModalFeature(f"img-{conv}-{i}", 1 + 8 * i, 8) for i in range(images)]
    tokens = [0] + [-1] * (8 * images) + [conv * 1000 + t for t in range(12 * turns)]
    return RouteKey.of(tokens, feats, BS)


def test_keys_are_the_prefix_caches_and_a_next_turn_extends_them() -> None:
    one, two = chat(1, 1), chat(1, 2)
    assert two.blocks[:len(one.blocks)] == one.blocks and len(two.blocks) > len(one.blocks)
    # the same tokens with another image: no block past the image's start is shared
    other = RouteKey.of([0] + [-1] * 16 + list(range(1000, 1012)),
                        [MultiModalFeature("x", 1, 8), MultiModalFeature("img-1-1", 9, 8)], BS)
    assert other.blocks[0] != one.blocks[0]


def test_a_chats_next_turn_goes_where_its_prefix_is() -> None:
    router = AffinityRouter(2, BS)
    first = [router.choose(chat(c, 1), [0, 0]) for c in range(4)]
    assert [r.reason for r in first] == ["balance"] * 4
    assert sorted(r.replica for r in first) == [0, 0, 1, 1]  # ties taken in turn
    for turn in (2, 3, 4):
        for c in range(4):
            route = router.choose(chat(c, turn), [0, 0])
            assert (route.replica, route.reason) == (first[c].replica, "affinity")
            assert route.matched_tokens == len(chat(c, turn - 1).blocks) * BS


def test_the_longest_prefix_wins_and_images_alone_count() -> None:
    router = AffinityRouter(3, BS)
    router.choose(chat(1, 1), [0, 0, 0])  # replica 0
    assert router.choose(chat(1, 3), [40, 0, 0]).reason == "busy"  # to replica 1
    assert router.choose(chat(1, 4), [0, 0, 0]).replica == 1  # the longer prefix
    # a new chat sending chat 1's second image (not at the start): its rows are encoded there
    feats = [MultiModalFeature("img-1-1", 2, 8)]
    key = RouteKey.of([7, 7] + [-1] * 8 + [3] * 4, feats, BS)
    route = router.choose(key, [0, 0, 5])
    assert route.replica in (0, 1) and route.reason == "affinity" and route.matched_tokens == 8


def test_a_much_busier_replica_loses_its_affinity() -> None:
    router = AffinityRouter(2, BS, balance_abs=4, balance_rel=1.5)
    assert router.choose(chat(1, 1), [0, 0]).replica == 0
    assert router.choose(chat(1, 2), [4, 0]).reason == "affinity"  # within the slack
    assert router.choose(chat(1, 3), [12, 10]).reason == "affinity"  # not 1.5 times
    route = router.choose(chat(1, 4), [20, 3])
    assert (route.replica, route.reason) == (1, "busy")
    # replica 1 now holds turn 4: turn 5 follows it
    assert router.choose(chat(1, 5), [0, 0]).replica == 1


def test_dead_replicas_are_left_out_and_come_back_empty() -> None:
    router = AffinityRouter(2, BS)
    assert router.choose(chat(1, 1), [0, 0]).replica == 0
    router.set_alive(0, False)
    assert router.choose(chat(1, 2), [0, 0]).replica == 1
    router.set_alive(1, False)
    with pytest.raises(LookupError):
        router.choose(chat(1, 3), [0, 0])
    router.set_alive(0, True)
    route = router.choose(chat(1, 3), [0, 0])
    assert (route.replica, route.reason) == (0, "balance")  # it forgot what it held


def test_tables_are_bounded_least_recently_used_first() -> None:
    router = AffinityRouter(2, BS, max_blocks=12, max_image_rows=16, min_match=0.0)
    router.choose(chat(1, 1), [0, 0])  # replica 0: 7 blocks, 2 images
    router.choose(chat(2, 1), [1, 0])  # replica 1
    router.choose(chat(3, 1), [0, 1])  # replica 0: chat 1's tail and images pushed out
    stats = router.stats()["replicas"][0]
    assert stats["table_blocks"] == 12 and stats["table_images"] == 2
    # chat 1's first blocks (recorded last) outlive its tail: still a partial match
    route = router.choose(chat(1, 2), [0, 0])
    assert route.replica == 0 and 0 < route.matched_tokens < len(chat(1, 1).blocks) * BS


def test_random_routing_is_seeded_and_ignores_prefixes() -> None:
    routers = [AffinityRouter(2, BS, "random", seed=s) for s in (0, 0, 1)]
    picks = [[r.choose(chat(1, t), [0, 0]).replica for t in range(1, 41)] for r in routers]
    assert picks[0] == picks[1] != picks[2]
    assert 10 < sum(picks[0]) < 30
    with pytest.raises(ValueError, match="affinity, random"):
        AffinityRouter(2, BS, "round-robin")


def test_a_short_shared_prefix_does_not_pull_every_chat_to_one_replica() -> None:
    router = AffinityRouter(2, BS)
    system = list(range(8))  # two blocks every chat starts with
    keys = [RouteKey.of(system + [c] * 24, [], BS) for c in range(4)]
    routes = [router.choose(k, [(i + 1) // 2, i // 2]) for i, k in enumerate(keys)]
    assert [r.replica for r in routes] == [0, 1, 0, 1]
    assert {r.reason for r in routes} == {"balance"}
    # a chat's next turn matches most of itself: affinity
    assert router.choose(RouteKey.of(system + [3] * 28, [], BS), [5, 0]).replica == 1
    assert router.choose(RouteKey.of(system + [2] * 28, [], BS), [0, 5]).replica == 0


def test_new_chats_spread_by_cache_room_while_loads_are_close() -> None:
    router = AffinityRouter(2, BS, balance_abs=4)
    # replica 0 answers faster (always less loaded): new chats still split evenly
    routes = [router.choose(chat(c, 1), [0, 1]) for c in range(8)]
    assert sorted(r.replica for r in routes) == [0, 0, 0, 0, 1, 1, 1, 1]
    tables = [r["table_blocks"] for r in router.stats()["replicas"]]
    assert tables[0] == tables[1] > 0
    # replica 1 holds more now but replica 0 is much busier: load decides
    router.choose(chat(9, 1), [0, 0])  # replica 0 (the turn's)
    assert router.choose(chat(10, 1), [30, 0]).replica == 1


def test_forget_empties_every_table() -> None:
    router = AffinityRouter(2, BS)
    first = router.choose(chat(1, 1), [0, 0]).replica
    assert router.choose(chat(1, 2), [0, 0]).reason == "affinity"
    router.forget()
    assert all(r["table_blocks"] == 0 for r in router.stats()["replicas"])
    route = router.choose(chat(1, 3), [0, 0])
    assert route.reason == "balance" and route.replica != first  # the next in turn
