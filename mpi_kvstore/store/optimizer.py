"""The optimizer inside the store (``set_optimizer``): every rank applies it to the same
sums, or with shard_optimizer each rank to its share of every key (optim.shards); the
global-norm clipped step (optim.shards.ClipStep); and the states, saved, loaded and
synced after a join. MXNet's per-key loops, held to one submit, are its base's
(heldloop.HeldLoop).

:class:`StoreOptimizer` is handed the store's key table (which owns the updater: set
through its set_updater, read there by Trainer and by push), its job (to submit the
norms' and the weights' collectives) and ``run`` (a Python-object collective,
collectives.Collectives.run). It never calls the store.
"""
import os
import pickle

import mxnet as mx
import numpy as np

from ..comm.collective import CLIP_NORM, LAMB_NORMS, Collective
from ..errors import MPIKVStoreError
from ..optim import batched, shards
from .heldloop import LOOP_GROUP_BYTES, TRAINER_LOOP, HeldLoop, LoopGate
from .keys import fill, note_weights, request

# LoopGate, LOOP_GROUP_BYTES and TRAINER_LOOP: heldloop's, named here too for the exchange
__all__ = ['StoreOptimizer', 'LoopGate', 'LOOP_GROUP_BYTES', 'TRAINER_LOOP']


class StoreOptimizer(HeldLoop):
    """The updater's part in push and pushpull (held in MXNet's loops by its base,
    heldloop.HeldLoop: :meth:`before`, :meth:`again` and :meth:`after` the exchange's
    collectives), clipping, and the states (save, load, join).

    ``gate``: the store's heldloop.LoopGate over ``job``, through which the exchange
    submits; this unit tells it which calls' collectives wait for their loop's last key."""

    def __init__(self, keys, config, rank, size, job, run, gate=None):
        super().__init__(keys, config, job, gate)
        self._rank, self._size = rank, size
        self._run = run
        self._fitted = set()   # keys whose optimizer state is cut to this rank's share
        self.clip = None       # the clipped step under way (shards.ClipStep)

    @property
    def updater(self):
        return self._keys.updater

    def set(self, optimizer):
        """MPIKVStore.set_optimizer."""
        self.release()
        if self._config.shard_optimizer:
            why = shards.refuse(optimizer)
            if why is not None:
                raise ValueError(why)
        self._keys.set_updater(batched.Updater(optimizer))
        self._fitted.clear()

    def require(self):
        if self.updater is None:
            raise MPIKVStoreError('no optimizer is set on this store: call set_optimizer first')
        return self.updater

    def clip_next_step(self, max_norm, keys):
        """MPIKVStore.clip_global_norm: check, then clip the step that pushes ``keys``."""
        self.require()
        self.release()
        shards.check_max_norm(max_norm)
        if isinstance(keys, (str, bytes, int)) or not hasattr(keys, '__iter__'):
            raise ValueError('clip_global_norm: keys must be a list of the step\'s keys, not %r'
                             % (keys,))
        keys = list(keys)
        if not keys or len(set(keys)) != len(keys):
            raise ValueError('clip_global_norm: keys must be distinct and not empty: %r'
                             % (keys,))
        if self.clip is not None:
            raise ValueError('clip_global_norm: the previous clipped step still waits for '
                             'keys %s: push them first' % (self.clip.waiting,))
        self.clip = shards.ClipStep(float(max_norm), keys)

    # -- push and pushpull (HeldLoop's hooks) -------------------------------------
    def _checked(self, plans):
        """Raise, before anything is sent, for a key the clipped step does not take, or a
        loaded state of another size; cut loaded whole states to this rank's share."""
        if self.clip is not None and self.updater is not None:
            self.clip.check([plan.state.key for plan in plans])
        for plan in plans:
            if plan.share is not None:
                self._fit_state(plan.state.key, plan.state.count, plan.share)

    def _settle(self, plans, priority):
        """Deliver a call, or with a clipped step under way add it, and deliver the whole
        step once its last key came."""
        step = self.clip if self.updater is not None else None
        if step is None:
            self._deliver(plans, priority)
        elif step.add(plans, priority):
            self.clip = None
            self._clip_step(step)

    def _clip_step(self, step):
        """A whole clipped step (shards.ClipStep): its norm, the scaled gradients, then each
        call's updates and allgathers, in call order."""
        sharded, whole = step.squares()
        if sharded is not None:
            # this rank's shares' squares, summed over the ranks: the sharded keys' part
            self._job.submit([Collective('allreduce', (CLIP_NORM,), np.dtype('float32'), (1,),
                                         array=sharded)],
                             max(priority for _, priority in step.calls))
        total = sharded if whole is None else whole if sharded is None else sharded + whole
        step.scale(total, self.updater.optimizer.rescale_grad)
        for plans, priority in step.calls:
            self._deliver(plans, priority)

    def _deliver(self, plans, priority):
        """The optimizer (on this rank's share where sharded) or the sums into the outputs
        (keys.KeyTable.deliver), then the sharded keys' allgathers."""
        sharded = [plan for plan in plans if plan.share is not None]
        lamb = sharded and shards.needs_norms(self.updater.optimizer)
        norms = []
        for plan in plans:
            if lamb and plan.share is not None:
                norms.append(shards.LambShare(self.updater, plan.state.key, plan.views[1],
                                              plan.views[0]))
                note_weights(plan)
            else:
                self._keys.deliver(plan)
        if norms:   # LAMB's norms over the whole weights: the shares' squares, summed
            self._job.submit([Collective('allreduce', (LAMB_NORMS, plan.state.key),
                                         np.dtype('float32'), (2,), array=share.squares)
                              for plan, share in zip(sharded, norms)], priority)
            for share in norms:
                share.finish()
        if sharded:
            self._job.submit([request('allgather', plan.state, plan.state.value,
                                      place=plan.place, shard=True) for plan in sharded],
                             priority)
            for plan in sharded:
                fill(plan, plan.state.value)

    # -- sharded states -------------------------------------------------------------
    def joined_share(self, key):
        """shards.JoinedShares' view of a key this rank shards: (weights, bounds, updater),
        or None. Called on the design's thread while this rank waits in join()."""
        state = self._keys.get(key)
        if state is None or state.value is None or not self._keys.sharded(state):
            return None
        bounds = self._keys.share_of(state)
        self._fit_state(key, state.count, bounds)
        return state.value, bounds, self.updater

    def _fit_state(self, key, count, bounds):
        """Cut ``key``'s state, loaded whole and not yet used, to ``bounds`` (shards.fit)."""
        states = self.updater.states
        if key in states and key not in self._fitted:
            states[key] = shards.fit(key, states[key], count, bounds)
            self._fitted.add(key)

    def _sharded_keys(self):
        return {st.key: (st.shape, st.count) for st in self._keys if self._keys.sharded(st)}

    # -- states -----------------------------------------------------------------------
    def save(self, fname, dump_optimizer):
        """MPIKVStore.save_optimizer_states (with shard_optimizer a collective)."""
        updater = self.require()
        self.release()
        if self._config.shard_optimizer and self._size > 1:
            self._job.wait()
            whole = mx.optimizer.Updater(updater.optimizer)
            whole.states = shards.gather(
                updater.states, self._sharded_keys(), self._size, self._rank,
                lambda obj: self._run(lambda comm: comm.allgather(obj),
                                      'gather_optimizer_states'))
            updater = whole
        data = updater.get_states(dump_optimizer)
        tmp = '%s.tmp.%d' % (fname, os.getpid())   # ranks may share a file system
        with open(tmp, 'wb') as fh:
            fh.write(data)
        os.replace(tmp, fname)

    def load(self, fname):
        """MPIKVStore.load_optimizer_states."""
        updater = self.require()
        self.release()
        with open(fname, 'rb') as fh:
            data = fh.read()
        loaded = mx.optimizer.Updater(updater.optimizer)
        loaded.set_states(data)
        for key, state in loaded.states.items():
            known = self._keys.get(key)
            if known is not None:
                shards.check_sizes(key, state, known.count, None)
        # what Updater.set_states(data) would set, without unpickling the file again
        updater.states, updater.states_synced = loaded.states, loaded.states_synced
        updater.optimizer = loaded.optimizer
        self._fitted.clear()   # whole states: cut to this rank's share at first use

    def sync_from(self, root):
        """After a join: every rank takes ``root``'s optimizer states (a collective)."""
        states = self._run(lambda comm: comm.bcast(
            self._states_to_sync() if self._rank == root else None, root=root),
            'join_optimizer')
        if self.updater is None or self._rank == root:
            return
        if self._config.shard_optimizer:   # each keeps its shares (JoinedShares)
            states = pickle.loads(states)
            self.updater.states.update(states)
            self.updater.states_synced.update(dict.fromkeys(states, False))
        else:
            self.updater.set_states(states)

    def _states_to_sync(self):
        """The optimizer states a join gives every rank: all of them, or with
        shard_optimizer those of the keys updated whole (each rank updated its own shares
        of the others, after its join too)."""
        if not self._config.shard_optimizer:
            return self.updater.get_states(False)
        sharded = self._sharded_keys()
        return pickle.dumps({key: state for key, state in self.updater.states.items()
                             if key not in sharded})
