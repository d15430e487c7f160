"""The gateway's gRPC health (grpc.health.v1): SERVING while any Triton replica is ready, so a
balancer stops routing here when every replica is down; replicas that come back are used again."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2

from specsplit.cloud.gateway.replicas import ReplicaSet
from specsplit.shared.protocol import SERVICE_NAME


async def update_health(replicas: ReplicaSet, servicer) -> None:
    ready = await replicas.refresh()
    status = health_pb2.HealthCheckResponse
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status.SERVING if ready else status.NOT_SERVING)


async def watch_health(replicas: ReplicaSet, servicer, period_s: float = 2.0) -> None:
    while True:
        await asyncio.sleep(period_s)
        await update_health(replicas, servicer)
