"""The gate's xdist scheduler: ``--dist=loadgroup`` (each ``xdist_group`` runs on one worker),
with the groups that share a costly resource pinned to a worker known before the run
(``dispatcher.gpu.warm.pinned_worker``), so that worker starts the resource in the background
right after it collected, while the others start; no worker takes a group pinned to another,
and one that has nothing left it may take is told so at once, also right after it was handed
its last unit (an xdist worker holds its last test until it learns no more work is coming). A worker that crashed fails the test it was
running (xdist's report) and its other work goes to a worker that is up; one started in its
place gets work once it has collected."""
from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

from ..gpu.warm import pinned_worker

__all__ = ["PinnedGroupScheduling"]


class PinnedGroupScheduling(LoadGroupScheduling):
    def _owner(self, scope: str):
        workers = self.config.getvalue("numprocesses") or len(self.nodes) or 1
        wanted = pinned_worker(scope, int(workers))
        if wanted is None:
            return None
        ids = {node.gateway.id: node for node in self.nodes}
        return wanted if wanted in ids else min(ids, default=None)  # its worker is gone: any

    def _next_scope(self, node):
        """The scope ``node`` runs next: its pinned groups first (their resource has been
        starting since this worker collected), then any unpinned one; None if nothing left
        is for it."""
        mine, free = node.gateway.id, None
        for scope in self.workqueue:
            owner = self._owner(scope)
            if owner == mine:
                return scope
            if owner is None and free is None:
                free = scope
        return free

    def remove_node(self, node):
        """A worker gone: at shutdown, nothing; after a crash, the test it was running
        (returned: xdist reports it failed, "worker crashed while running ...") is done, and
        the rest of its work goes back to the queue for a worker that is up (loadscope would
        run the crashing test again on every replacement, until the restarts run out)."""
        workload = self.assigned_work.pop(node, {})
        pending = [(scope, nodeid) for scope, unit in workload.items()
                   for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        scope, crashitem = pending[0]  # a worker runs its units in order
        workload[scope][crashitem] = True
        self.workqueue.update({s: u for s, u in workload.items() if not all(u.values())})
        for other in list(self.assigned_work):
            self._reschedule(other)
        return crashitem

    def _assign_work_unit(self, node) -> None:
        scope = self._next_scope(node)
        if scope is None:
            return
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items()
                                if not done])

    def _reschedule(self, node) -> None:
        if node.shutting_down or node not in self.registered_collections:
            return  # a worker started in a crashed one's place has not collected yet
        if self._next_scope(node) is None:  # nothing more will come: it runs what it holds
            node.shutdown()                 # (a worker keeps its last test until told so)
            return
        if self._pending_of(self.assigned_work[node]) > 2:
            return
        self._assign_work_unit(node)
        # A worker runs a test only once it holds the next one or is told to stop, and only a
        # finished test brings it here again: it holds two, or is told now (a worker started in
        # a crashed one's place, handed one unit of one test, waited for ever)
        while self._next_scope(node) is not None and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if self._next_scope(node) is None:
            node.shutdown()

    def schedule(self) -> None:
        assert self.collection_is_completed
        if self.collection is not None:
            for node in self.nodes:
                self._reschedule(node)
            return
        if not self._check_nodes_have_same_collection():
            self.log("**Different tests collected, aborting run**")
            return
        self.collection = list(next(iter(self.registered_collections.values())))
        if not self.collection:
            return
        units: dict = {}
        for nodeid in self.collection:
            units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
        for scope, nodeids in sorted(units.items(), key=lambda item: -len(item[1])):
            self.workqueue[scope] = nodeids  # the largest units first, as loadgroup does
        for node in self.nodes:
            if node in self.registered_collections:
                self._assign_work_unit(node)
        for node in self.nodes:
            self._reschedule(node)  # a second unit each where there is one, else shutdown
