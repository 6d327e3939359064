"""The store's optimizer sends the collectives of MXNet's per-key loops together
(scenarios/kv_trainer_loop.py, store/heldloop.LoopGate): in gluon.Trainer's loop with the
optimizer in the store, every call but the loop's last is held and one submit a step sends
them all (the 'loop' debug counter), or one per group of LOOP_GROUP_BYTES; the weights after
every step are bitwise those of the Trainer's own updates (update_on_kvstore=False) and, to
float32 tolerance, those of one process on the whole batch, with SGD and with Adam; a loop
that raises before its last key leaves its calls held until the next store call, which
sends them and delivers their updates (bitwise a whole step's weights for those keys, the
last key's untouched); a user's own loop is never held. With update_on_kvstore=False the
Trainer's loop of prepared pushpulls is held too (store/exchange.Exchange.again): one
submit a step from the third, the weights bitwise those of the same loop unheld.
2 ranks, on every design."""
import pytest

from mpi_harness import result, run_designs

STEPS, KEYS = 4, 12   # the scenario's steps, and its Trainer's keys (6 Dense layers)


@pytest.mark.parametrize('design', ['funneled', 'chained', 'concurrent', 'blocking'])
def test_a_trainer_loop_goes_as_one_submit_with_the_same_weights(design, designs):
    out = run_designs(2, 'kv_trainer_loop.py', design, designs, timeout=300)
    name = 'kv_trainer_loop[%s]' % design
    assert '%s: OK' % name in out, out[-3000:]
    for rank in result(out, name)['ranks']:
        counts = rank['counts']
        for opt in ('sgd', 'adam'):
            # from the third step, each call but the loop's first and last in one function
            assert counts['gluon ' + opt] == {'held': STEPS * (KEYS - 1), 'submit': STEPS,
                                              'again': (STEPS - 2) * (KEYS - 2)}
            # update_on_kvstore=False: held from the third step, when its calls are prepared
            assert counts['gluon %s, own updates' % opt] == {'held': (STEPS - 2) * (KEYS - 1),
                                                             'submit': STEPS - 2}
            # the store's submits (one engine op each): the keys' init, then one a key a
            # step unheld; one a step instead where held
            assert counts['gluon %s, own updates, submits' % opt] == [
                KEYS + 2 * KEYS + STEPS - 2, KEYS + STEPS * KEYS]
        # a group bound of 3 keys' bytes: two groups a step
        assert counts['gluon sgd, groups'] == {'held': STEPS * (KEYS - 2), 'submit': 2 * STEPS,
                                               'again': (STEPS - 2) * (KEYS - 2)}
        assert counts['interrupted'] == {'held': KEYS - 1, 'submit': 1}
        checked, expected = rank['checked'], rank['expected']
        assert len(checked) == 2 * STEPS * KEYS + 3
        for what, (shape, total) in checked.items():
            assert shape == expected[what][0], what
            assert total == pytest.approx(expected[what][1], rel=1e-3, abs=1e-3), what
