"""The examples run end to end under mpiexec, print one honest summary, and learn.

Each job runs on 2 ranks with a hard timeout; the checks read rank 0's epoch lines:
    epoch 1/1: loss=2.2951 acc=0.1250 val_loss=... val_acc=... images/s=52.3 time=4.1s
"""
import math
import pickle
import re
import struct
import zlib

import numpy as np
import pytest

from mpi_harness import run_mpi

NPROCS = 2
SUMMARY = re.compile(r'epoch (\d+)/(\d+): loss=(\S+) acc=(\S+)'
                     r'(?: val_loss=(\S+) val_acc=(\S+))? images/s=(\S+) time=(\S+)s')

# Small settings: the point is that every path runs, not speed (2-core CI machines).
SMOKE = {
    'train_cifar10.py': ('--width', 8, '--batch-size', 8),
    'train_imagenet.py': ('--batch-size', 2),
    'train_module.py': ('--width', 8, '--batch-size', 8),
}


def summaries(output):
    """Every epoch summary line as a dict of floats, in order."""
    out = []
    for m in SUMMARY.finditer(output):
        names = ('epoch', 'epochs', 'loss', 'acc', 'val_loss', 'val_acc', 'images_s', 'time')
        out.append({n: float(v) for n, v in zip(names, m.groups()) if v is not None})
    return out


def check_epochs(output, epochs):
    """One summary per epoch (rank 0 alone prints), with finite numbers."""
    found = summaries(output)
    assert [s['epoch'] for s in found] == list(range(1, epochs + 1)), output[-3000:]
    for s in found:
        assert all(math.isfinite(v) for v in s.values()), s
        assert s['loss'] > 0 and 0 <= s['acc'] <= 1, s
        assert s['images_s'] > 0, s
    return found


@pytest.mark.parametrize('script', sorted(SMOKE))
def test_example_runs(script, mpi_available):
    out = run_mpi(NPROCS, 'examples/' + script, '--steps', 2, '--epochs', 1,
                  *SMOKE[script], timeout=300)
    assert '%d rank(s)' % NPROCS in out, out[-3000:]
    (summary,) = check_epochs(out, 1)
    assert 0 <= summary['val_acc'] <= 1, summary


@pytest.mark.parametrize('design', ['concurrent', 'chained', 'blocking'])
def test_cifar10_designs(design, mpi_available):
    out = run_mpi(NPROCS, 'examples/train_cifar10.py', '--design', design, '--steps', 2,
                  '--epochs', 2, '--width', 4, '--batch-size', 4, timeout=180)
    assert 'design %s' % design in out, out[-3000:]
    check_epochs(out, 2)


def test_cifar10_learns_synthetic_set(mpi_available):
    """80 steps of 32 images: the loss falls between epochs, accuracy beats chance (0.1)."""
    out = run_mpi(NPROCS, 'examples/train_cifar10.py', '--steps', 40, '--epochs', 2,
                  '--width', 8, '--batch-size', 16, timeout=240)
    first, second = check_epochs(out, 2)
    assert second['loss'] < first['loss'], (first, second)
    assert second['acc'] > 0.4 and second['val_acc'] > 0.5, second


def write_cifar10(folder, per_file=40):
    """A tiny folder in CIFAR-10's python format: pickled dicts of uint8 rows and labels."""
    rng = np.random.default_rng(0)
    for name in ['data_batch_%d' % i for i in range(1, 6)] + ['test_batch']:
        batch = {b'data': rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
                 b'labels': [int(v) for v in rng.integers(0, 10, per_file)]}
        with open(folder / name, 'wb') as f:
            pickle.dump(batch, f)


@pytest.mark.parametrize('script', ['train_cifar10.py', 'train_module.py'])
def test_reads_cifar10_folder(script, tmp_path, mpi_available):
    write_cifar10(tmp_path)
    out = run_mpi(NPROCS, 'examples/' + script, '--data', tmp_path, '--steps', 3,
                  '--epochs', 1, '--width', 4, '--batch-size', 8, timeout=180)
    assert '3 steps/epoch' in out, out[-3000:]
    check_epochs(out, 1)


def _png(pixels):
    """A minimal RGB PNG (no OpenCV or PIL in the test environment)."""
    def chunk(kind, data):
        crc = zlib.crc32(kind + data) & 0xffffffff
        return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', crc)
    height, width, _ = pixels.shape
    raw = b''.join(b'\x00' + row.tobytes() for row in pixels)
    header = struct.pack('>IIBBBBB', width, height, 8, 2, 0, 0, 0)
    return (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IDAT', zlib.compress(raw))
            + chunk(b'IEND', b''))


def write_rec(path, count, classes):
    """A small indexed RecordIO file of random images, like im2rec writes."""
    import mxnet as mx  # here, so collecting the other tests does not pay for it
    rng = np.random.default_rng(0)
    writer = mx.recordio.MXIndexedRecordIO(str(path)[:-4] + '.idx', str(path), 'w')
    for i in range(count):
        image = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
        header = mx.recordio.IRHeader(0, float(i % classes), i, 0)
        writer.write_idx(i, mx.recordio.pack(header, _png(image)))
    writer.close()


def test_imagenet_reads_recordio(tmp_path, mpi_available):
    """--rec: each rank reads its part; a short part restarts rather than skip a step."""
    rec = tmp_path / 'tiny.rec'
    write_rec(rec, 21, classes=4)
    out = run_mpi(NPROCS, 'examples/train_imagenet.py', '--rec', rec, '--val-rec', rec,
                  '--classes', 4, '--model', 'resnet18_v1', '--batch-size', 2,
                  '--epochs', 2, timeout=240)
    assert '5 steps/epoch' in out, out[-3000:]  # 21 records // 2 ranks // batch 2
    check_epochs(out, 2)
