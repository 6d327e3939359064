"""The examples, importable as a package so that benchmarks can share their code
(benchmarks/scaling.py trains examples.cifar_resnet's resnet20). Users run them as scripts:
``python examples/train_cifar10.py``."""
