"""The store's data path below its contract: a broadcast of keys, the exchange of a push
or pushpull (each key's collective built whole, with its codec and share decided here),
and the weights' sync after a join.

:class:`Exchange` is handed the key table, the job it submits to, the optimizer unit
(optimizer.StoreOptimizer, which delivers the sums) and ``run`` (a Python-object
collective). A pushpull goes store -> keys (plans) -> exchange -> job -> design, and
back to the store only by returning.
"""
import sys

import mxnet as mx
import numpy as np

from .. import compression, debug
from ..comm.collective import Collective
from ..engine.records import Prepared
from .keys import request, same_array
from .namecache import Batch
from .optimizer import TRAINER_LOOP as _TRAINER

# the debug counters a repeated call (Exchange.again) adds, by call: made once, counted in one
_HITS = {call: (('call_cache', 'hit'), ('fastpath', 'hit'), ('again', call))
         for call in ('pushpull', 'push')}

__all__ = ['Exchange']


class Exchange:
    """Collectives of keys. ``codec``: set_gradient_compression's (compression.TwoBit), or
    None; the store option ``compression`` gives the wire cast, fixed."""

    def __init__(self, keys, config, job, optimizer, run, direct=None):
        self._keys, self._config = keys, config
        self._job, self._optimizer, self._run = job, optimizer, run
        # the job under the gate (``job``), which the one-function path submits to once it
        # saw the gate hold nothing
        self._direct = job if direct is None else direct
        self._wire = compression.wire_cast(config.compression)
        self.codec = None

    def set_compression(self, params):
        """MPIKVStore.set_gradient_compression (for the calls made after it)."""
        self.codec = compression.from_params(params, self._config.two_phase_min_ranks)

    def _codec_for(self, dtype):
        for codec in (self.codec, self._wire):
            if codec is not None and codec.applies_to(dtype):
                return codec
        return None

    def broadcast(self, entries, priority, root=0):
        """Rank ``root``'s values into the store and every out (validated entries)."""
        states = [self._keys.register(entry) for entry in entries]
        for state, entry in zip(states, entries):
            # the stored value may be the Trainer's weights themselves (keys.KeyTable.aim)
            if not same_array(entry.values[0], state.stored()):
                entry.values[0].copyto(state.stored())
        self._job.submit([request('bcast', st, st.value, root=root) for st in states],
                         priority)
        for state, entry in zip(states, entries):
            for out in entry.outs or ():
                if not same_array(out, state.value):
                    state.value.copyto(out)
            if entry.outs:
                # Module broadcasts its cached _arg_params into the executors' arrays:
                # a join must update both, the arrays in use first.
                state.weights = tuple(entry.outs) + tuple(
                    v for v in entry.values if not any(same_array(v, o) for o in entry.outs))

    def run(self, plans, priority):
        """Allreduce each key, or with shard_optimizer reduce-scatter it, then let the
        optimizer unit deliver (update this rank's share and allgather the weights)."""
        self._optimizer.before(plans)
        self._send(plans, priority)
        self._optimizer.after(plans, priority)

    def _send(self, plans, priority):
        average = self._config.average
        reqs = []
        for plan in plans:
            plan.stage()
            sharded = plan.share is not None
            reqs.append(request('reducescatter' if sharded else 'allreduce', plan.state,
                                plan.work, average=average, in_place=plan.in_place,
                                place=plan.place, codec=self._codec_for(plan.state.dtype),
                                shard=sharded))
        self._job.submit(reqs, priority)

    def again(self, ready, key, value, out, priority):
        """A push or pushpull repeated on the very arrays of a prepared call, without the
        store's optimizer, in one function: ``ready`` (CallCache.pushpull or .push) holds
        the call by key; it must be the same priority, codec and design, with nothing held
        by the gate. True once submitted (staged and delivered as :meth:`replay` would);
        False: nothing was done, the caller takes the full path (which also says what is
        wrong)."""
        kind = key.__class__
        if kind is int or kind is str:
            entry = ready.get(key)
        elif kind is list or kind is tuple:
            try:
                entry = ready.get(tuple(key))
            except TypeError:
                return False
        else:
            return False
        if entry is None or priority.__class__ is not int or entry.priority != priority:
            return False
        if not entry.matches(value, out):
            return False
        job, gate = self._direct, self._job
        if job.closed or entry.codec is not self.codec or entry.prepared.owner is not job.design:
            return False
        if self._keys.updater is not None:   # a held call of an MXNet loop, or the full path
            return self._optimizer.again(entry, priority)
        staged = entry.staged
        # gluon.Trainer's loop of pushpulls (update_on_kvstore=False), in place: held until
        # the loop's last key (heldloop.LoopGate.hold_loop); any other call goes once the
        # gate holds nothing
        loop = sys._getframe(2)
        if loop.f_code is not _TRAINER or staged:
            loop = None
        if gate.reqs and (loop is None or gate.loop is not loop):
            return False
        errors = job.errors
        if errors.waiting:   # one test when nothing failed, not a call
            errors.raise_pending()
        debug.count_all(_HITS[entry.call])
        models = entry.models
        if loop is None and not staged:   # the common call: renewed by the design or job
            repeat = job.again_direct   # the design's one function, else the job's
            if repeat is None or not repeat(entry.prepared, models, priority, job.pending):
                job.again(entry.prepared, models, priority)
            return True
        reqs = Batch.renewed(models, entry.prepared)
        if loop is not None:
            gate.hold_loop(loop, key, reqs, priority)
            return True
        for plan in staged:
            plan.stage()
        job.submit(reqs, priority)
        if staged:
            deliver = self._keys.deliver
            for plan in staged:
                deliver(plan)
        return True

    def replay(self, entry, priority):
        """A call found again (namecache.Replay): the prepared path where nothing it was
        prepared for changed (the same codec and priority, and with the store's optimizer
        no shard and the same arrays aimed at: keys.KeyTable.aim): requests made from
        their models (Collective.renewed), with the engine's prepared call, staged and delivered as
        :meth:`run` would. Anything else goes the way of :meth:`run`, and the entry is
        prepared again for the next call.

        With the store's optimizer the optimizer unit runs before and after the
        collectives exactly as in :meth:`run` (its batching, clipping and aim); only the
        requests and the engine op are the prepared ones. True where the entry is prepared
        for the one-function path (:meth:`again`; with the optimizer, for a held loop's
        calls: heldloop.HeldLoop.again)."""
        codec = self.codec
        optimizer = self._keys.updater is not None
        if optimizer:
            if entry.sharded is None:
                entry.sharded = any(plan.share is not None for plan in entry.plans)
            if entry.sharded:   # reduce-scatter and allgather: not prepared
                debug.count('fastpath', 'miss')
                self.run(entry.plans, priority)
                return False
            self._optimizer.before(entry.plans)
            if entry.models is not None and not all(
                    plan.work is work for plan, work in zip(entry.plans, entry.works)):
                entry.models = None   # aimed elsewhere (another caller): prepared anew
                debug.count('fastpath', 'miss')
                self._send(entry.plans, priority)
                self._prepare(entry, priority, codec)
                self._optimizer.after(entry.plans, priority)
                return False
        if entry.models is None:
            self._prepare(entry, priority, codec)
        elif (entry.priority != priority or entry.codec is not codec
              or entry.prepared.owner is not self._job.design):
            debug.count('fastpath', 'miss')
            if optimizer:
                self._send(entry.plans, priority)
                self._prepare(entry, priority, codec)
                self._optimizer.after(entry.plans, priority)
            else:
                self.run(entry.plans, priority)
                self._prepare(entry, priority, codec)
            return not optimizer
        debug.count('fastpath', 'hit')
        reqs = Batch.renewed(entry.models, entry.prepared)
        for plan in entry.staged:
            plan.stage()
        self._job.submit(reqs, priority)
        if optimizer:
            self._optimizer.after(entry.plans, priority)
            return True
        deliver = self._keys.deliver
        for plan in entry.staged:
            deliver(plan)
        return True

    def _prepare(self, entry, priority, codec):
        """The models of ``entry``'s requests (unnumbered) as :meth:`run` makes them, for ``priority``
        and ``codec``, and the engine's prepared call over their arrays."""
        reqs = [request('allreduce', plan.state, plan.work, average=self._config.average,
                        in_place=plan.in_place, place=plan.place,
                        codec=self._codec_for(plan.state.dtype))
                for plan in entry.plans]
        entry.models = [Collective(r.kind, r.key, r.dtype, r.shape, r.array, r.root, None,
                                   r.average, 0, r.nbytes, r.sig, r.place, 1, r.codec, False,
                                   r.in_place) for r in reqs]
        entry.staged = [plan for plan in entry.plans if not plan.in_place]
        entry.works = [plan.work for plan in entry.plans]
        entry.priority, entry.codec = priority, codec
        entry.prepared = Prepared([r.array for r in reqs if r.array is not None],
                                  self._job.design)

    def sync_from(self, root):
        """Every rank takes ``root``'s weights and optimizer states (after a join)."""
        updater = self._optimizer.updater
        mine = [(st.key, st.shape, st.dtype.str) for st in self._keys
                if st.weights or st.value is not None]
        keys, has_updater = self._run(
            lambda comm: comm.bcast((mine, updater is not None), root=root), 'join_keys')
        reqs, deliveries = [], []
        for key, shape, dtype in keys:
            state = self._keys.get(key)
            if state is not None and (state.shape, state.dtype.str) == (shape, dtype):
                buf, outs = state.stored(), state.weights
                if outs and not same_array(outs[0], buf):
                    outs[0].copyto(buf)
            else:  # a key this rank never held: take part, keep nothing
                buf, outs = mx.nd.zeros(shape, dtype=dtype), ()
            reqs.append(Collective('bcast', ('join', key), np.dtype(dtype), shape, array=buf,
                                   root=root))
            deliveries.append((buf, outs))
        if reqs:
            self._job.submit(reqs, 0)
        for buf, outs in deliveries:
            for out in outs:
                if not same_array(out, buf):
                    buf.copyto(out)
        if has_updater:
            self._optimizer.sync_from(root)
        self._job.wait()
