"""By hand, not in CI (it needs Horovod's repository): run Horovod's own MXNet example scripts
with only their import line changed to ``import mpi_kvstore.horovod as hvd``, and check what
they train. docs/coming-from-horovod.md has the commands and the outcomes.

    python tests/horovod_targets.py prepare WORKDIR HOROVOD_GIT_DIR
        copies examples/mxnet/mxnet_mnist.py and mxnet_imagenet_resnet50.py into WORKDIR
        with the import changed (and ``import horovod``, used only for horovod.run, removed),
        writes a synthetic MNIST-shaped data-RANK/mnist.zip for 2 ranks (the script's
        download is skipped when the file exists: this machine cannot reach the dataset) and
        a small RecordIO image set
    mpiexec -n 2 python tests/horovod_targets.py run MODE OUT.npz SCRIPT [ARGS...]
        runs SCRIPT as ``python SCRIPT ARGS`` would, with every random generator seeded, and
        saves the trained weights; raises unless every rank ends bitwise equal to rank 0.
        MODE store: as written. reference: hvd.DistributedTrainer and DistributedOptimizer
        replaced by Horovod's CPU arithmetic in numpy and mpi4py (the gradients' sum,
        rescale_grad * predivide / size; with fp16 the sum in float16), no store involved.
        sum: the store, with gradients summed instead of averaged (what renaming
        ``mpi_kvstore`` to hvd would train).
    python tests/horovod_targets.py compare A.npz B.npz
        the relative distance of two trained models: |A - B| / |B| over all weights
"""
import io
import os
import re
import runpy
import struct
import sys
import zipfile
import zlib

import numpy as np


def prepare(workdir, git_dir):
    import subprocess
    os.makedirs(workdir, exist_ok=True)
    for name in ('mxnet_mnist.py', 'mxnet_imagenet_resnet50.py'):
        text = subprocess.check_output(['git', '-C', git_dir, 'show',
                                        'HEAD:examples/mxnet/' + name], text=True)
        changed = text.replace('import horovod.mxnet as hvd', 'import mpi_kvstore.horovod as hvd')
        changed = re.sub(r'^import horovod\n', '', changed, flags=re.MULTILINE)
        assert changed.count('mpi_kvstore.horovod') == 1
        with open(os.path.join(workdir, name), 'w') as fh:
            fh.write(changed)
    for rank in range(2):
        folder = os.path.join(workdir, 'data-%d' % rank)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, 'mnist.zip'), 'wb') as fh:
            fh.write(mnist_zip())
    write_images(os.path.join(workdir, 'images'), count=8, classes=4)


def mnist_images(count, seed):
    """Ten class templates (three bright blobs each), shifted by up to 2 pixels, plus noise."""
    yy, xx = np.mgrid[0:28, 0:28]
    layout = np.random.RandomState(7)
    templates = []
    for _ in range(10):
        image = np.zeros((28, 28))
        for cy, cx in layout.randint(6, 22, size=(3, 2)):
            image += np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / 8.0)
        templates.append(image / image.max())
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 10, count)
    images = np.empty((count, 28, 28))
    for i, label in enumerate(labels):
        shifted = np.roll(templates[label], rng.randint(-2, 3, size=2), axis=(0, 1))
        images[i] = shifted + rng.normal(0, 0.25, (28, 28))
    return (np.clip(images, 0, 1) * 255).astype(np.uint8), labels.astype(np.uint8)


def _idx(array, magic):
    header = struct.pack('>I', magic) + b''.join(struct.pack('>I', n) for n in array.shape)
    return header + array.tobytes()


def mnist_zip(train=6000, test=1000):
    """A zip of the four MNIST idx files, as the one the script downloads holds."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, 'w') as zf:
        for prefix, count, seed in (('train', train, 0), ('t10k', test, 1)):
            images, labels = mnist_images(count, seed)
            zf.writestr('%s-images-idx3-ubyte' % prefix, _idx(images, 2051))
            zf.writestr('%s-labels-idx1-ubyte' % prefix, _idx(labels, 2049))
    return out.getvalue()


def write_images(prefix, count, classes):
    """prefix.rec and prefix.idx: COUNT 256x256 PNG images, as im2rec writes them."""
    import mxnet as mx
    rng = np.random.default_rng(0)
    writer = mx.recordio.MXIndexedRecordIO(prefix + '.idx', prefix + '.rec', 'w')
    for i in range(count):
        image = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
        header = mx.recordio.IRHeader(0, float(i % classes), i, 0)
        writer.write_idx(i, mx.recordio.pack(header, _png(image)))
    writer.close()


def _png(pixels):
    """An RGB PNG of a (height, width, 3) uint8 array."""
    def chunk(kind, data):
        return (struct.pack('>I', len(data)) + kind + data
                + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff))
    height, width, _ = pixels.shape
    raw = b''.join(b'\x00' + row.tobytes() for row in pixels)
    header = struct.pack('>IIBBBBB', width, height, 8, 2, 0, 0, 0)
    return (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IDAT', zlib.compress(raw))
            + chunk(b'IEND', b''))


# ---------------------------------------------------------------------------------- run
def _reference_classes(hvd, mx, comm):
    """Horovod's CPU arithmetic, without the store: sums by mpi4py, in rank order."""

    def summed(grad, fp16):
        local = grad.asnumpy()
        parts = comm.allgather(local.astype(np.float16) if fp16 else local)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        grad[:] = mx.nd.array(total.astype(local.dtype), ctx=grad.context)

    class Trainer(mx.gluon.Trainer):
        def __init__(self, params, optimizer, optimizer_params=None,
                     compression=hvd.Compression.none, gradient_predivide_factor=1.0,
                     prefix=None, num_groups=0):
            super().__init__(params, optimizer, optimizer_params, kvstore=None)
            self._predivide = gradient_predivide_factor
            self._fp16 = compression is hvd.Compression.fp16
            self._scale *= gradient_predivide_factor / comm.Get_size()

        def _allreduce_grads(self):
            for param in self._params:
                if param.grad_req != 'null':
                    grad = param.list_grad()[0]
                    grad *= 1.0 / self._predivide
                    summed(grad, self._fp16)

    class Optimizer(mx.optimizer.Optimizer):
        def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0):
            self._optimizer = optimizer
            self._predivide = gradient_predivide_factor
            optimizer.rescale_grad *= gradient_predivide_factor / comm.Get_size()

        def __getattr__(self, item):
            if item.startswith('__') or item == '_optimizer':
                raise AttributeError(item)
            return getattr(self._optimizer, item)

        def create_state_multi_precision(self, index, weight):
            return self._optimizer.create_state_multi_precision(index, weight)

        def create_state(self, index, weight):
            return self._optimizer.create_state(index, weight)

        def _reduce(self, grad):
            for g in grad if isinstance(grad, (list, tuple)) else [grad]:
                g *= 1.0 / self._predivide
                summed(g, False)

        def update(self, index, weight, grad, state):
            self._reduce(grad)
            self._optimizer.update(index, weight, grad, state)

        def update_multi_precision(self, index, weight, grad, state):
            self._reduce(grad)
            self._optimizer.update_multi_precision(index, weight, grad, state)

    return Trainer, Optimizer


def run(mode, out, script, args):
    import mxnet as mx
    from mpi4py import MPI

    import mpi_kvstore.horovod as hvd
    comm = MPI.COMM_WORLD
    seen = {'trainers': [], 'weights': {}}
    if mode == 'reference':
        hvd.DistributedTrainer, hvd.DistributedOptimizer = _reference_classes(hvd, mx, comm)
    trainer_class, optimizer_class = hvd.DistributedTrainer, hvd.DistributedOptimizer

    class Trainer(trainer_class):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if mode == 'sum':
                self._scale *= comm.Get_size()
            seen['trainers'].append(self)

    class Optimizer(optimizer_class):
        def __init__(self, optimizer, *a, **k):
            super().__init__(optimizer, *a, **k)
            if mode == 'sum':
                optimizer.rescale_grad *= comm.Get_size()

        def _record(self, index, weight):
            indices = index if isinstance(index, (list, tuple)) else [index]
            weights = weight if isinstance(weight, (list, tuple)) else [weight]
            seen['weights'].update(zip(indices, weights))

        def update(self, index, weight, grad, state):
            self._record(index, weight)
            super().update(index, weight, grad, state)

        def update_multi_precision(self, index, weight, grad, state):
            self._record(index, weight)
            super().update_multi_precision(index, weight, grad, state)

    hvd.DistributedTrainer, hvd.DistributedOptimizer = Trainer, Optimizer
    np.random.seed(1)
    mx.random.seed(1)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name='__main__')
    mx.nd.waitall()
    weights = {}
    local = set()     # BatchNorm's running statistics: each rank's own, in Horovod too
    for trainer in seen['trainers']:
        for i, param in enumerate(trainer._params):
            weights['t%d:%s' % (i, param.name)] = param.data().asnumpy()
            if param.grad_req == 'null':
                local.add('t%d:%s' % (i, param.name))
    for index, weight in seen['weights'].items():
        weights['m%s' % (index,)] = weight.asnumpy()
    assert weights, 'no DistributedTrainer or DistributedOptimizer was used'
    worst = 0.0
    for name in sorted(weights):
        mine = weights[name]
        ref = comm.bcast(mine if comm.Get_rank() == 0 else None, root=0)
        if name not in local and not np.array_equal(mine, ref):
            worst = max(worst, float(np.abs(mine.astype(np.float64) - ref).max()))
    worst = comm.allreduce(worst, op=MPI.MAX)
    if comm.Get_rank() == 0:
        np.savez(out, **{name: value for name, value in weights.items() if name not in local})
        print('horovod_targets: %s %s: %d trained arrays %s%s' % (
            mode, os.path.basename(script), len(weights) - len(local),
            'bitwise identical on all %d ranks' % comm.Get_size() if worst == 0
            else 'DIFFER across ranks by up to %g' % worst,
            ' (and %d running statistics, each rank\'s own as in Horovod)' % len(local)
            if local else ''), flush=True)
    if worst:
        raise SystemExit('the ranks ended with different weights')


def compare(a, b):
    a, b = np.load(a), np.load(b)
    assert sorted(a.files) == sorted(b.files), 'different models'
    diff = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a.files)
    norm = sum(float(np.sum(b[k].astype(np.float64) ** 2)) for k in b.files)
    worst = max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a.files)
    print('relative distance %.3g (%.4f%%), largest element difference %.3g over %d arrays'
          % ((diff / norm) ** 0.5, 100 * (diff / norm) ** 0.5, worst, len(a.files)))


if __name__ == '__main__':
    command = sys.argv[1]
    if command == 'prepare':
        prepare(sys.argv[2], sys.argv[3])
    elif command == 'run':
        run(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    elif command == 'compare':
        compare(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
