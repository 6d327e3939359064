"""Horovod's gradient_predivide_factor folded into the reduction, and scale factors that
ranks must agree on as given (issue 43, after test_hvd_scale_fold).

scenarios/hvd_scale_agree.py on every design at 2 ranks: hvd.DistributedTrainer with
gradient_predivide_factor 4 and 3 (num_groups 0 and 2), uncompressed float32, trains to the
weights of one plain gluon.Trainer on the whole batch with no engine op of its own for the
factor (debug 'hvd': 'scale_op' 0; rescale_grad holds 1/batch, the factor cancelled); with
Compression.fp16 the prescale stays an op a gradient a step and rescale_grad holds the
factor. hvd.DistributedOptimizer with predivide 3 equals plain SGD on the mean gradient in
numpy, one index and an aggregated list: no scale op for float32, one a float16 gradient.
Ranks splitting one product differently, (prescale, postscale) (2, 1) against (1, 2), and
ranks giving an int32 tensor different prescales, fail with RankMismatchError on every
rank naming both ranks' factors (Horovod 0.28.1: 'Mismatched prescale and/or postscale
factors'); the name sums right after. All of these fail on the code before: the product
alone was in the signature, and the predivide factor an op of its own.

The unit tests check the signature: the same product split differently signs apart, a
plain sum signs as before, and the mismatch message names the split.
"""
import numpy as np
import pytest

from mpi_kvstore.comm.collective import Collective
from mpi_kvstore.designs import NAMES
from mpi_kvstore.designs.mismatch import describe, explain

from mpi_harness import result, run_designs

SPLIT = 'rank 0 has prescale 2.0 and postscale 1.0, rank 1 has prescale 1.0 and postscale 2.0'
INT = 'rank 0 has prescale 2.0 and postscale 1.0, rank 1 has prescale 3.0 and postscale 1.0'


@pytest.mark.parametrize('design', NAMES)
def test_predivide_folds_and_ranks_agree_on_the_factors_as_given(design, designs):
    out = run_designs(2, 'hvd_scale_agree.py', design, designs, timeout=300)
    name = 'hvd_scale_agree[%s]' % design
    assert '%s: OK at 2 ranks' % name in out, out[-3000:]
    for rank in result(out, name)['ranks']:
        # [scale ops over 3 steps, gradients a step, rescale_grad * whole batch]
        (none4, none3, fp16) = rank['trainers']
        assert none4[:2] == [0, 4] and none3[:2] == [0, 4], rank['trainers']
        assert none4[2] == pytest.approx(1.0) and none3[2] == pytest.approx(1.0)
        assert fp16[:2] == [3 * 4, 4] and fp16[2] == pytest.approx(2.0), fp16
        assert rank['optimizer'] == [0, 3], rank['optimizer']
        said = rank['mismatch']
        for what in ('split allreduce_', 'split allreduce', 'split grouped'):
            assert SPLIT in said[what], (what, said[what])
        assert INT in said['int prescale'], said['int prescale']
        assert rank['raised'] == ['RankMismatchError'] * 4
        # trainers: 3 x 4 weights; optimizer: 4 weights x 3 steps; 4 ways x 2 calls after
        assert len(rank['checked']) == 12 + 12 + 8, sorted(rank['checked'])
        for what, (shape, total) in rank['checked'].items():
            assert shape == rank['expected'][what][0], what
            tol = 2e-2 if 'fp16' in what or what.startswith('optimizer 3') else 1e-4
            assert total == pytest.approx(rank['expected'][what][1], rel=tol, abs=tol), what


F32 = np.dtype(np.float32)


def test_the_factors_as_given_join_the_signature():
    """(2, 1) and (1, 2) fold the same factor, 2, yet sign apart; a plain sum (no scale)
    signs as it did; the same scale signs the same."""
    plain = Collective('allreduce', 'x', F32, (4,))
    pre = Collective('allreduce', 'x', F32, (4,), factor=2.0, scale=(2.0, 1.0))
    post = Collective('allreduce', 'x', F32, (4,), factor=2.0, scale=(1.0, 2.0))
    again = Collective('allreduce', 'x', F32, (4,), factor=2.0, scale=(1.0, 2.0))
    folded = Collective('allreduce', 'x', F32, (4,), factor=2.0)
    assert plain.sig == Collective('allreduce', 'x', F32, (4,), factor=1.0, scale=None).sig
    assert len({plain.sig, pre.sig, post.sig, folded.sig}) == 4
    assert post.sig == again.sig
    assert post.renewed().scale == (1.0, 2.0) and post.renewed().sig == post.sig
    # an integer prescale (an op: the factor stays 1.0) still signs apart
    two = Collective('allreduce', 'x', np.dtype(np.int32), (4,), scale=(2.0, 1.0))
    three = Collective('allreduce', 'x', np.dtype(np.int32), (4,), scale=(3.0, 1.0))
    assert two.sig != three.sig


def test_the_mismatch_names_the_split_and_only_the_factor_where_it_differs():
    def said(*reqs):
        every = []
        for req in reqs:
            req.number(7, 0)
            every.append([describe(req)])
        return explain(every)
    split = said(Collective('allreduce', 'x', F32, (4,), factor=2.0, scale=(2.0, 1.0)),
                 Collective('allreduce', 'x', F32, (4,), factor=2.0, scale=(1.0, 2.0)))
    assert SPLIT in split, split
    product = said(Collective('allreduce', 'x', F32, (4,), factor=2.0, scale=(1.0, 2.0)),
                   Collective('allreduce', 'x', F32, (4,), factor=3.0, scale=(1.0, 3.0)))
    assert 'rank 0 has scale factor 2.0, rank 1 has scale factor 3.0' in product, product
    assert 'prescale' not in product, product
    plain = said(Collective('allreduce', 'x', F32, (4,)),
                 Collective('allreduce', 'x', F32, (4,), scale=(2.0, 0.5)))
    assert 'rank 0 has no prescale or postscale, rank 1 has prescale 2.0 and postscale 0.5' \
        in plain, plain
