"""The optimizer inside the store (``set_optimizer``): every rank applies it to the same
sums, or with shard_optimizer each rank to its share of every key (optim.shards); the
global-norm clipped step (optim.shards.ClipStep); and the states, saved, loaded and
synced after a join.

:class:`StoreOptimizer` is handed the store's key table (which owns the updater: set
through its set_updater, read there by Trainer and by push), its job (to submit the
norms' and the weights' collectives) and ``run`` (a Python-object collective,
collectives.Collectives.run). It never calls the store.
"""
import os
import pickle
import sys

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet import model as mx_model

from .. import debug
from ..comm.collective import CLIP_NORM, LAMB_NORMS, Collective
from ..engine.records import Prepared
from ..errors import MPIKVStoreError
from ..optim import batched, shards
from .keys import fill, note_weights, request
from .namecache import Batch

__all__ = ['StoreOptimizer', 'LoopGate', 'LOOP_GROUP_BYTES', 'TRAINER_LOOP']

# Bytes of a loop's held collectives that go out together, without waiting for the loop's
# last key: a large model's first groups are reduced while backward still makes the others
# (DistributedTrainer's group_bytes, whose default this is).
LOOP_GROUP_BYTES = 4 << 20


# MXNet's own loops that push one key a call, in order, and read no weights until the
# loop ends: gluon.Trainer._allreduce_grads (update_on_kvstore) and Module's
# model._update_params_on_kvstore. For each, the last key the loop pushes this time,
# read from the loop's frame.
def _trainer_last(frame):
    params = frame.f_locals['self']._params
    for i in range(len(params) - 1, -1, -1):
        if params[i].grad_req != 'null':
            return i
    return None


def _module_last(frame):
    local = frame.f_locals
    grads = local['grad_arrays']
    for i in range(len(grads) - 1, -1, -1):
        if grads[i][0] is not None:
            return local['param_names'][i]
    return None


_TRAINER = TRAINER_LOOP = gluon.Trainer._allreduce_grads.__code__
_LOOPS = {_TRAINER: _trainer_last,
          mx_model._update_params_on_kvstore.__code__: _module_last}
_DEPTH = 6   # frames from StoreOptimizer.before up to the store's caller, and a margin


def _loop(held=None, held_last=None):
    """(the code of the MXNet loop this push or pushpull comes from, the last key it pushes
    this time, the loop's frame), or (None, None, None) for any other caller (each of its
    calls is then delivered at once, and its arrays are used as today). ``held``: the frame
    of the loop whose calls the gate holds, whose last key is ``held_last`` (not read
    again: the loop's locals are made into a dict at each read)."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            break
        if frame is held:
            return frame.f_code, held_last, frame
        last = _LOOPS.get(frame.f_code)
        if last is not None:
            return frame.f_code, last(frame), frame
        frame = frame.f_back
    return None, None, None


def _batches(updater):
    """Whether the updater's optimizer runs a list of keys as MXNet's multi-tensor updates,
    aggregate_num keys an operator: MXNet's SGD, whose multi-tensor update is elementwise,
    so that a batch gives the very same weights as one key at a time. Any other optimizer
    gains nothing from a batch, or could round otherwise."""
    optimizer = updater.optimizer
    return isinstance(optimizer, mx.optimizer.SGD) and optimizer.aggregate_num > 1


class LoopGate:
    """The store's job as the exchange sees it. Where the store's optimizer runs MXNet's own
    per-key loop (StoreOptimizer.before says so by ``holding``), each call's collectives
    are held, and go out with the loop's last key's, or once LOOP_GROUP_BYTES are held, as
    one submit: one engine op and one agreement for the loop instead of one per key, as a
    DistributedTrainer's grouped pushpull. The loop's last key is known before it is
    pushed (read from the loop's frame), so nothing waits on a time: a key pushed alone,
    or by any other caller, goes at once. Any other submit sends what is held first, in
    call order. The engine's record of the combined op is prepared once for the very same
    arrays (engine.records.Prepared), as a repeated call's. Everything else is the job's."""

    def __init__(self, job):
        self._job = job
        self.holding = False   # set by StoreOptimizer.before for a call whose requests wait
        self.reqs = []         # the held requests, in call order
        self._priority = None  # the highest priority of the held calls
        self._nbytes = 0
        self._prepared = None
        # gluon.Trainer's loop without the store's optimizer (hold_loop): its frame while
        # it holds calls, and its last key
        self.loop = self._last = None

    def hold_loop(self, frame, key, reqs, priority):
        """A pushpull of gluon.Trainer's loop with update_on_kvstore=False (``frame``),
        prepared and in place (Exchange.again): held, or with the loop's last key (read from
        its frame once a run of the loop) sent with every call held, as one submit."""
        if self.loop is not frame:
            self.loop, self._last = frame, _trainer_last(frame)
        last = key == self._last
        self.holding = not last
        try:
            self.submit(reqs, priority)
        finally:
            self.holding = False
        if last:
            self.loop = None

    def __getattr__(self, name):   # design, wait, begin, errors, ...: the job's
        return getattr(self._job, name)

    def submit(self, reqs, priority):
        if self.reqs or self.holding:
            self.reqs.extend(reqs)
            self._priority = priority if self._priority is None else max(self._priority,
                                                                         priority)
            for req in reqs:
                self._nbytes += req.nbytes
            if self.holding and self._nbytes < LOOP_GROUP_BYTES:
                debug.count('loop', 'held')
                return
            self.send()
            return
        self._job.submit(reqs, priority)

    def send(self):
        """Submit the held requests as one call."""
        reqs, priority = self.reqs, self._priority
        if not reqs:
            return
        self.reqs, self._priority, self._nbytes = [], None, 0
        debug.count('loop', 'submit')
        arrays = [req.array for req in reqs if req.array is not None]
        prepared = self._prepared
        design = self._job.design
        if (prepared is None or prepared.owner is not design
                or len(prepared.arrays) != len(arrays)
                or not all(a is b for a, b in zip(arrays, prepared.arrays))):
            prepared = self._prepared = Prepared(arrays, design)
        batch = Batch(reqs)
        batch.prepared = prepared
        self._job.submit(batch, priority)


class StoreOptimizer:
    """The updater's part in push and pushpull (:meth:`before` and :meth:`after` the
    exchange's collectives), clipping, and the states (save, load, join).

    ``gate``: the store's :class:`LoopGate` over ``job``, through which the exchange
    submits; this unit tells it which calls' collectives wait for their loop's last key."""

    def __init__(self, keys, config, rank, size, job, run, gate=None):
        self._keys, self._config = keys, config
        self._rank, self._size = rank, size
        self._job, self._run = job, run
        self.gate = gate if gate is not None else LoopGate(job)
        self._fitted = set()   # keys whose optimizer state is cut to this rank's share
        self.clip = None       # the clipped step under way (shards.ClipStep)
        self._last = None      # before() -> after(): the batching loop's last key, or None
        self._frame = None     # the loop whose collectives the gate holds
        self._frame_last = None   # and its last key
        self._batching = (None, 0, False)   # (optimizer, its aggregate_num, _batches)
        self._waiting = []     # (plans, priority) of calls whose collectives are held

    def release(self, flush=True):
        """Send what the gate holds and deliver the calls that waited for it (a store call
        other than the loop's next; the loop's end sends them itself). ``flush``: deliver
        held updates too."""
        self.gate.holding = False
        self._frame = self._frame_last = self.gate.loop = None
        self.gate.send()
        self._after_sent()
        if flush:
            self._keys.flush()

    def idle(self):
        """Whether nothing is held: no collective by the gate, no call's delivery, no
        update (what :meth:`release` would send or deliver)."""
        return not (self.gate.reqs or self._waiting or self._keys.holding())

    def _after_sent(self):
        waiting, self._waiting = self._waiting, []
        for plans, priority in waiting:
            self._after(plans, priority)

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

    # -- push and pushpull --------------------------------------------------------
    def before(self, plans):
        """Raise, before anything is sent, for a key the clipped step does not take, or a
        loaded state of another size; cut loaded whole states to this rank's share.

        Decide whether the call's updates wait for a batch: only in MXNet's own loops
        (_LOOPS), with no clipped step and no shard, and never past the loop's last key.
        Held updates of other calls are delivered first, before this call stages its
        gradients, unless this call joins their batch.

        In gluon.Trainer's loop (and only there: a user's own call never has its input
        written) a single-device key is reduced in the gradient itself and updated in the
        Trainer's weights, which become the store's value (keys.KeyTable.aim): two engine
        copies a key less, and param.grad() then holds the sum over the ranks, as with
        update_on_kvstore=False."""
        updater = self._keys.updater
        code = last = frame = None
        if (updater is not None and self.clip is None
                and all(plan.share is None for plan in plans)):
            code, last, frame = _loop(self._frame, self._frame_last)
        gate = self.gate
        gate.holding = False
        if (gate.reqs or self._waiting) and frame is not self._frame:
            self.release(flush=False)   # not the held loop's next call: the held go first
        if last is not None:
            optimizer, batching = updater.optimizer, self._batching
            if batching[0] is not optimizer or batching[1] != optimizer.aggregate_num:
                batching = self._batching = (optimizer, optimizer.aggregate_num,
                                             _batches(updater))
            self._last = last if batching[2] else None
        else:
            self._last = None
        if last is not None and not any(plan.state.key == last for plan in plans):
            gate.holding, self._frame, self._frame_last = True, frame, last
        else:
            self._frame = self._frame_last = None
        if self._last is None or self._keys.holds(plans):
            self._keys.flush()
        if updater is not None:
            direct = (code is _TRAINER and self._config.zero_copy
                      and not self._config.shard_optimizer)
            for plan in plans:
                if plan.share is None:
                    self._keys.aim(plan, direct)
        if self.clip is not None and updater is not None:
            self.clip.check([plan.state.key for plan in plans])
        for plan in plans:
            if plan.share is not None:
                self._fit_state(plan.state.key, plan.state.count, plan.share)

    def again(self, entry, priority):
        """A prepared call (namecache.Replay ``entry``, its codec, priority and design
        unchanged: Exchange.again) of the loop whose earlier call :meth:`before` held, other
        than its last key, in one function: its keys aimed as :meth:`before` aims them, its
        requests (made from the entry's templates) held by the gate, its delivery waiting
        for the loop's last key, as the full path (Exchange.replay) would. True once done;
        False, with nothing sent, for any other call (another caller, the loop's last key, a
        clipped step, a sharded or held key, arrays aimed elsewhere): the full path."""
        frame = self._frame
        if (frame is None or sys._getframe(3) is not frame or self.clip is not None
                or entry.sharded is not False):
            return False
        plans, keys, last = entry.plans, self._keys, self._frame_last
        for plan in plans:
            if plan.state.key == last:
                return False
        if keys.holds(plans):
            return False
        config = self._config
        direct = frame.f_code is _TRAINER and config.zero_copy and not config.shard_optimizer
        for plan, work in zip(plans, entry.works):
            keys.aim(plan, direct)
            if plan.work is not work:
                return False
        self._job.errors.raise_pending()
        debug.count('call_cache', 'hit')
        debug.count('fastpath', 'hit')
        debug.count('loop', 'again')
        if self._last is None:
            keys.flush()
        reqs = [Collective(*args) for args in entry.templates]
        for plan in entry.staged:
            plan.stage()
        gate = self.gate
        gate.holding = True
        gate.submit(reqs, priority)
        self.after(plans, priority)
        return True

    def after(self, plans, priority):
        """After a call's collectives were submitted (or, in a loop, held by the gate):
        once the gate holds none, deliver the calls that waited, in call order, then this
        one (:meth:`_after`)."""
        self.gate.holding = False
        if self.gate.reqs:
            self._waiting.append((plans, priority))
            return
        if self._waiting:
            self._after_sent()
        self._after(plans, priority)

    def _after(self, plans, priority):
        """Deliver a call, or with a clipped step under way add it, and deliver the whole
        step once its last key came."""
        step = self.clip if self.updater is not None else None
        if self._last is not None:
            self._keys.hold(plans)
            if any(plan.state.key == self._last for plan in plans):
                self._keys.flush()
        elif step is None:
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
