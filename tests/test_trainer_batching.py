"""The store's optimizer batches gluon.Trainer's and Module's per-key updates
(scenarios/kv_trainer_batching.py): after every step the same weights as one key at a time
and as the Trainer's own updates, bitwise, and as one process on the whole batch, to float32
tolerance, at 2 ranks; the Trainer's gradients hold the sums (reduced in place), and a user's
own pushpull leaves its input as it was; a step's updates are one updater call (the 'optimizer' debug
counter), which MXNet's SGD runs aggregate_num keys an operator; from the second step on the
Trainer's pushpulls take the prepared path (the 'fastpath' counter's hits), and from the
third on each call of the loop but its first and last its one function (the 'loop' counter's
'again', heldloop.HeldLoop.again)."""
import pytest

from mpi_harness import result, run_designs

# the scenario's model: 12 Dense layers, one frozen (22 keys trained), 3 steps; Module: 6
# FullyConnected layers (12 keys)
STEPS, GLUON_KEYS, MODULE_KEYS = 3, 22, 12
AGAIN = (STEPS - 2) * (GLUON_KEYS - 2)
OPTS = ('sgd', 'sgd_wd', 'adam', 'adam_wd')


@pytest.mark.parametrize('design', ['funneled', 'chained'])
def test_batched_updates_give_the_same_weights(design, designs):
    out = run_designs(2, 'kv_trainer_batching.py', design, designs, timeout=300)
    name = 'kv_trainer_batching[%s]' % design
    assert '%s: OK' % name in out, out[-3000:]
    batches = {'batch': STEPS}
    one_by_one = {'key': STEPS * GLUON_KEYS}
    for rank in result(out, name)['ranks']:
        counts = rank['counts']
        for opt in OPTS:   # the prepared path from the second step on, optimizer set
            # and from the third step on each of the loop's keys but its first and last
            # in one function (HeldLoop.again)
            assert counts['fastpath gluon ' + opt] == {'hit': (STEPS - 1) * GLUON_KEYS,
                                                       'loop again': AGAIN}
        for opt in ('sgd', 'sgd_wd'):
            assert counts['gluon ' + opt] == batches
            # from the second step, from the groups the store's updater keeps
            assert counts['planned gluon ' + opt] == STEPS - 1
            assert counts['gluon %s, aggregate_num 1' % opt] == one_by_one
        for opt in ('adam', 'adam_wd'):     # no multi-tensor Adam in MXNet 1.9.1: per key
            assert counts['gluon ' + opt] == one_by_one
            assert counts['planned gluon ' + opt] == 0
        assert counts['module sgd'] == batches
        assert counts['module sgd, aggregate_num 1'] == {'key': STEPS * MODULE_KEYS}
        assert counts['own loop'] == {'key': 3}
        checked, expected = rank['checked'], rank['expected']
        assert len(checked) == 4 * STEPS * (2 * 12) + MODULE_KEYS + 3
        for what, (shape, total) in checked.items():
            assert shape == expected[what][0], what
            assert total == pytest.approx(expected[what][1], rel=1e-3, abs=1e-3), what
