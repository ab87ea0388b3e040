"""Cache-affine routing of Ray Serve requests to vlmserve LLM replicas: Serve's request router
extension (`ray.serve.request_router.RequestRouter`) over the same policy as
`--data-parallel-size` (`core/dp_routing.AffinityRouter`).

The ingress does no tokenizing or image decoding (every replica does its own): its key of a
request is read from the request's JSON (`request_key`): each message's role and text as
bytes, each image or video as one run of `IMAGE_UNITS` units keyed by the hash of its URL (a
data URL: its bytes), chained over blocks of `BLOCK_UNITS` units. A chat's next turn re-sends
the earlier messages unchanged, so its first blocks are the previous turn's: it goes to the
replica that served that turn, unless much busier (load: the requests this router has in
flight there).
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from vlmserve.core.dp_routing import AffinityRouter, RouteKey
from vlmserve.multimodal.inputs import MultiModalFeature

BLOCK_UNITS = 64  # units (bytes of text, image runs) per block of a request's key
IMAGE_UNITS = 256  # what one image weighs against text (most images are hundreds of tokens)
_MEDIA = ("image_url", "video_url", "input_image")

# every replica of the routers in this process by unique id (the ingress reads them for /stats)
REPLICAS: dict[str, ReplicaID] = {}


def request_key(body: dict[str, Any]) -> RouteKey | None:
    """The routing key of an OpenAI chat or completion request's JSON (None: nothing to key)."""
    units: list[int] = []
    media: list[MultiModalFeature] = []
    if isinstance(body.get("messages"), list):
        for msg in body["messages"]:
            if not isinstance(msg, dict):
                continue
            units += f"<{msg.get('role')}>".encode()
            content = msg.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else (
                content if isinstance(content, list) else [])
            for part in parts:
                if not isinstance(part, dict):
                    continue
                kind = part.get("type")
                if kind == "text" and isinstance(part.get("text"), str):
                    units += part["text"].encode()
                elif kind in _MEDIA:
                    ref = part.get(kind)
                    url = ref.get("url") if isinstance(ref, dict) else ref
                    digest = hashlib.sha256(str(url).encode()).hexdigest()
                    media.append(MultiModalFeature(digest, len(units), IMAGE_UNITS))
                    units += [-1] * IMAGE_UNITS
    elif isinstance(body.get("prompt"), str):
        units += body["prompt"].encode()
    if not units:
        return None
    return RouteKey.of(units, media, BLOCK_UNITS)


class AffinityRequestRouter(RequestRouter):
    """Serve's router for the LLM replicas: the replica `AffinityRouter` picks for a request's
    `route_key` (a keyword argument of the call: `request_key`; `route_loads`: requests in
    flight by replica), then the others by load; a
    call with `route_to` (a replica's unique id) goes to that replica if it runs; a call
    with neither to the least loaded. Set as the deployment's `request_router_config`."""

    def initialize_state(self, mode: str = "affinity", seed: int = 0, **policy: Any) -> None:
        self.policy = AffinityRouter(0, BLOCK_UNITS, mode, seed=seed, **policy)
        self.index: dict[ReplicaID, int] = {}

    def _index(self, replica_id: ReplicaID) -> int:
        i = self.index.get(replica_id)
        if i is None:
            i = self.index[replica_id] = self.policy.add_replica()
            REPLICAS[replica_id.unique_id] = replica_id
        return i

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if kwargs.get("route_reset"):  # the replicas' prefix caches are being emptied
            self.policy.forget()
        in_flight = kwargs.get("route_loads") or {}  # the ingress's, by replica unique id
        by_load = sorted(candidate_replicas,
                         key=lambda r: in_flight.get(r.replica_id.unique_id, 0))
        target = kwargs.get("route_to")
        if target is not None:
            return [[r] for r in by_load if r.replica_id.unique_id == target] + [by_load]
        key = kwargs.get("route_key")
        if key is None:
            return [by_load]
        ids = [self._index(r.replica_id) for r in candidate_replicas]
        loads = [0] * self.policy.num_replicas
        for r, i in zip(candidate_replicas, ids, strict=True):
            loads[i] = in_flight.get(r.replica_id.unique_id, 0)
        chosen = self.policy.choose(key, loads, among=ids).replica
        first = [r for r, i in zip(candidate_replicas, ids, strict=True) if i == chosen]
        return [first, [r for r in by_load if r not in first]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id for r in replicas}
        for replica_id in [rid for rid in self.index if rid not in current]:
            self.on_replica_actor_died(replica_id)  # gone (scaled down, replaced)
            del self.index[replica_id]
        for r in replicas:
            self._index(r.replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        if replica_id in self.curr_replicas:
            super().on_replica_actor_died(replica_id)
        if replica_id in self.index:
            self.policy.set_alive(self.index[replica_id], False)
        REPLICAS.pop(replica_id.unique_id, None)
