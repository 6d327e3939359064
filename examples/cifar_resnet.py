"""He et al.'s CIFAR ResNet (6n+2 layers), shared by examples/train_cifar10.py and
benchmarks/scaling.py so that both train the same net."""
from mxnet.gluon import nn

__all__ = ['BasicBlock', 'resnet20']


class BasicBlock(nn.HybridBlock):
    """Two 3x3 convolutions and a shortcut (a strided 1x1 conv where the shape changes)."""

    def __init__(self, channels, stride, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = nn.HybridSequential()
            self.body.add(nn.Conv2D(channels, 3, stride, 1, use_bias=False), nn.BatchNorm(),
                          nn.Activation('relu'),
                          nn.Conv2D(channels, 3, 1, 1, use_bias=False), nn.BatchNorm())
            self.shortcut = None
            if stride != 1:
                self.shortcut = nn.HybridSequential()
                self.shortcut.add(nn.Conv2D(channels, 1, stride, use_bias=False),
                                  nn.BatchNorm())

    def hybrid_forward(self, F, x):
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(self.body(x) + skip)


def resnet20(classes=10, width=16, blocks=3):
    """He et al.'s CIFAR ResNet (6n+2 layers, n=3): three stages of width, 2x, 4x channels."""
    net = nn.HybridSequential()
    with net.name_scope():
        net.add(nn.Conv2D(width, 3, 1, 1, use_bias=False), nn.BatchNorm(), nn.Activation('relu'))
        for stage in range(3):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                net.add(BasicBlock(width << stage, stride))
        net.add(nn.GlobalAvgPool2D(), nn.Dense(classes))
    return net
