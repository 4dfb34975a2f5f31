"""A demotion into a full host tier is offered its victims first (issue 42, item 6): host memory of
exactly the host budget (a pinned slab, the adapter's host arena) holds the new copy only in the
victims' room, and the store drops them after the copy, so it names them before `demote`
(`make_room`); a demotion that fails leaves them in the store."""

from store_helpers import deposit, keys

from trtllm_mtp_carry import CarryStore


class RoomMoves:
    """Records `make_room` and the moves; `gone`: keys whose demotion fails."""

    def __init__(self):
        self.calls = []
        self.gone = set()

    def make_room(self, victims):
        self.calls.append(("make_room", [e.session_hash for e in victims]))

    def demote(self, e):
        self.calls.append(("demote", e.session_hash))
        return e.session_hash not in self.gone

    def restore(self, e):
        self.calls.append(("restore", e.session_hash))

    def drop(self, e):
        self.calls.append(("drop", e.session_hash))


def host_keys(store):
    return [e.session_hash for e in store.host_entries]


def test_a_demotion_into_a_full_host_tier_names_its_victims_before_the_copy_and_drops_them_after():
    store = CarryStore(budget_bytes=10, policy="lrd", host_budget_bytes=10)
    store.host_moves = moves = RoomMoves()
    deposit(store, 1)
    deposit(store, 2)  # 1 demoted into the empty host tier: no victims
    deposit(store, 3)  # 2 demoted, 1 its victim
    assert moves.calls == [("make_room", []), ("demote", 1), ("make_room", [1]), ("demote", 2), ("drop", 1)]
    assert keys(store) == [3] and host_keys(store) == [2]


def test_a_failed_demotion_keeps_the_victims_it_was_offered():
    store = CarryStore(budget_bytes=10, policy="lrd", host_budget_bytes=10)
    store.host_moves = moves = RoomMoves()
    deposit(store, 1)
    deposit(store, 2)
    moves.gone.add(2)
    deposit(store, 3)
    assert moves.calls[-2:] == [("make_room", [1]), ("demote", 2)]  # no drop: 1 stays
    assert keys(store) == [3] and host_keys(store) == [1]
