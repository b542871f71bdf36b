"""The ``verbs`` backend: RDMA READ / atomic fetch-and-add over RC queue pairs (pyverbs).

Every rank opens the device, registers its buffers once (snapshot at the core, gradient at each
cell leader, counter at the controller), and connects one RC queue pair to every peer whose
memory it reads; the addresses, keys, QP numbers and GIDs are exchanged over MPI at start.
Reads are RDMA READ, the claim is IBV_WR_ATOMIC_FETCH_AND_ADD: the owner's CPU takes no part.

Consistency is the runtime's protocol, not a lock: the core publishes version v+1 only after
every pull of v has been acknowledged, and reads the version word after the values.
This code runs only where an RDMA device exists (``transport.backend = auto`` checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gyre_hpc.recipe.schema import TransportConfig
from gyre_hpc.transport.base import TransportPlan

HEADER = 8
SLICE_HEADER = 16  # version and byte count before a weight slice
MAX_READ = 1 << 30  # bytes per work request (the HCA's max message size is 2 GiB)


@dataclass(frozen=True)
class _Remote:
    qpn: int
    gid: bytes
    lid: int
    regions: dict[str, tuple[int, int]]  # name -> (address, rkey)


class VerbsTransport:
    name = "verbs"

    def __init__(self, comm: Any, plan: TransportPlan, config: TransportConfig) -> None:
        from pyverbs import enums as e
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD

        self.e, self.comm, self.plan = e, comm, plan
        self.rank, size = comm.Get_rank(), comm.Get_size()
        names = [d.name.decode() for d in get_device_list()]
        device = config.verbs_device or names[0]
        self.ctx = Context(name=device)
        self.port, self.gid_index = config.verbs_port, config.gid_index
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 256)
        n = plan.params
        self._snap = np.zeros(HEADER + 4 * n if self.rank == plan.core else 8, dtype=np.uint8)
        if self.rank == plan.core:
            self._snap[:HEADER].view(np.int64)[0] = -1
        self._grad = np.zeros(plan.grads.get(self.rank, 0) or 2, dtype=np.float32)
        self._counter = np.zeros(1, dtype=np.int64)
        self._slice = np.zeros(SLICE_HEADER + plan.slices.get(self.rank, 0), dtype=np.uint8)
        self._slice[:8].view(np.int64)[0] = -1  # nothing published yet
        self._landing = np.zeros(SLICE_HEADER, dtype=np.uint8)  # headers and fetch-and-add results
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC
        self.mrs = {
            name: self._register(buf, access)
            for name, buf in (
                ("snap", self._snap),
                ("slice", self._slice),
                ("grad", self._grad),
                ("counter", self._counter),
            )
        }
        self.mrs["landing"] = self._register(self._landing, e.IBV_ACCESS_LOCAL_WRITE)
        self._scratch: dict[int, Any] = {}  # destination buffers registered on first use
        # One QP per peer, built locally, then connected with the peer's numbers.
        self.qps = {peer: self._make_qp() for peer in range(size) if peer != self.rank}
        gid = self.ctx.query_gid(self.port, self.gid_index)
        lid = self.ctx.query_port(self.port).lid
        mine = {
            peer: _Remote(
                qp.qp_num,
                bytes(str(gid), "ascii"),
                lid,
                {k: (mr.buf, mr.rkey) for k, mr in self.mrs.items() if k != "landing"},
            )
            for peer, qp in self.qps.items()
        }
        theirs = comm.alltoall([mine.get(peer) for peer in range(size)])
        self.remotes: dict[int, _Remote] = {p: r for p, r in enumerate(theirs) if p != self.rank}
        for peer, qp in self.qps.items():
            self._connect(qp, self.remotes[peer])
        comm.Barrier()  # every QP is ready to receive before anyone reads

    def _register(self, buf: np.ndarray, access: int) -> Any:
        from pyverbs.mr import MR

        return MR(self.pd, max(buf.nbytes, 8), access, address=buf.ctypes.data)

    def _make_qp(self) -> Any:
        from pyverbs.qp import QP, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=64, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        return QP(self.pd, QPInitAttr(qp_type=self.e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))

    def _connect(self, qp: Any, remote: _Remote) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        e = self.e
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=self.port)
        attr.qp_access_flags = (
            e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC | e.IBV_ACCESS_LOCAL_WRITE
        )
        qp.to_init(attr)
        route = GlobalRoute(dgid=GID(val=remote.gid.decode()), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, grh=route, dlid=remote.lid)
        attr.dest_qp_num = remote.qpn
        attr.path_mtu = e.IBV_MTU_4096
        attr.max_dest_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.rq_psn = 0
        qp.to_rtr(attr)
        attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.sq_psn, attr.max_rd_atomic = 14, 7, 7, 0, 16
        qp.to_rts(attr)

    # ---- the interface ----------------------------------------------------------------------

    def publish(self, weights: np.ndarray, version: int) -> None:
        assert self.rank == self.plan.core, "only the core publishes"
        self._snap[:HEADER].view(np.int64)[0] = -1
        self._snap[HEADER:].view(np.float32)[:] = weights.reshape(-1)
        self._snap[:HEADER].view(np.int64)[0] = version

    def pull_snapshot(self, into: np.ndarray) -> int:
        addr, rkey = self.remotes[self.plan.core].regions["snap"]
        self._read(self.plan.core, into.reshape(-1).view(np.uint8), addr + HEADER, rkey)
        self._read(self.plan.core, self._landing[:HEADER], addr, rkey)
        return int(self._landing.view(np.int64)[0])

    def publish_slice(self, data: np.ndarray, version: int) -> None:
        data = data.reshape(-1).view(np.uint8)
        if data.size > self._slice.size - SLICE_HEADER:
            raise ValueError(f"a slice of {data.size} bytes, rank {self.rank} exposes {self._slice.size}")
        self._slice[SLICE_HEADER : SLICE_HEADER + data.size] = data
        self._slice[:SLICE_HEADER].view(np.int64)[:] = (version, data.size)

    def pull_slice(self, rank: int, into: np.ndarray) -> tuple[int, int]:
        addr, rkey = self.remotes[rank].regions["slice"]
        self._read(rank, self._landing, addr, rkey)
        version, nbytes = (int(v) for v in self._landing.view(np.int64)[:2])
        dest = into.reshape(-1).view(np.uint8)
        if nbytes > dest.size:
            raise ValueError(f"rank {rank}'s slice has {nbytes} bytes, the buffer {dest.size}")
        if nbytes > 0:
            self._read(rank, dest[:nbytes], addr + SLICE_HEADER, rkey)
        return version, nbytes

    def gradient_buffer(self) -> np.ndarray:
        return self._grad

    def pull_gradient(self, rank: int, into: np.ndarray) -> None:
        exposed = self.plan.grads.get(rank, 0)
        if into.size != exposed:
            raise ValueError(f"buffer of {into.size} values, rank {rank} exposes {exposed}")
        addr, rkey = self.remotes[rank].regions["grad"]
        self._read(rank, into.reshape(-1).view(np.uint8), addr, rkey)

    def claim(self) -> int:
        from pyverbs.wr import SGE, SendWR

        owner = self.plan.counter
        if owner == self.rank:  # a QP to oneself is not set up: local atomics suffice (single owner)
            value = int(self._counter[0])
            self._counter[0] = value + 1
            return value
        addr, rkey = self.remotes[owner].regions["counter"]
        landing = self.mrs["landing"]
        wr = SendWR(
            wr_id=1,
            opcode=self.e.IBV_WR_ATOMIC_FETCH_AND_ADD,
            num_sge=1,
            sg=[SGE(landing.buf, 8, landing.lkey)],
            send_flags=self.e.IBV_SEND_SIGNALED,
        )
        # compare_add is the addend of a fetch-and-add; swap is ignored by it.
        wr.set_wr_atomic(rkey=rkey, addr=addr, compare_add=1, swap=1)
        self._post_and_wait(owner, [wr])
        return int(self._landing.view(np.int64)[0])

    def reset_counter(self) -> None:
        assert self.rank == self.plan.counter
        self._counter[0] = 0

    def claimed(self) -> int:
        assert self.rank == self.plan.counter
        return int(self._counter[0])

    def _read(self, peer: int, dest: np.ndarray, addr: int, rkey: int) -> None:
        from pyverbs.wr import SGE, SendWR

        mr = self._scratch_mr(dest)
        base = dest.ctypes.data
        wrs = []
        for i, at in enumerate(range(0, dest.nbytes, MAX_READ)):
            length = min(MAX_READ, dest.nbytes - at)
            wr = SendWR(
                wr_id=i,
                opcode=self.e.IBV_WR_RDMA_READ,
                num_sge=1,
                sg=[SGE(base + at, length, mr.lkey)],
                send_flags=self.e.IBV_SEND_SIGNALED,
            )
            wr.set_wr_rdma(rkey=rkey, addr=addr + at)
            wrs.append(wr)
        self._post_and_wait(peer, wrs)

    def _scratch_mr(self, dest: np.ndarray) -> Any:
        """Destination buffers are registered once and kept (registration is the slow part)."""
        if dest.ctypes.data == self._landing.ctypes.data:
            return self.mrs["landing"]
        key = dest.ctypes.data
        if key not in self._scratch:
            self._scratch[key] = self._register(dest, self.e.IBV_ACCESS_LOCAL_WRITE)
        return self._scratch[key]

    def _post_and_wait(self, peer: int, wrs: list[Any]) -> None:
        qp = self.qps[peer]
        for wr in wrs:
            qp.post_send(wr)
        done = 0
        while done < len(wrs):
            n, wcs = self.cq.poll(num_entries=len(wrs) - done)
            for wc in wcs[:n]:
                if wc.status != self.e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"RDMA work request to rank {peer} failed: status {wc.status}")
            done += n

    def close(self) -> None:
        for qp in self.qps.values():
            qp.close()
        for mr in [*self.mrs.values(), *self._scratch.values()]:
            mr.close()
        self.cq.close()
        self.pd.close()
        self.ctx.close()
