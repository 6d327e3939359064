"""python -m benchmarks.cost_model: its modes (docs/cost-model.md shows them)."""
import json
import os
import sys
import time

from benchmarks import harness
from benchmarks.cost_model import __doc__ as DOC
from benchmarks.cost_model.fit import (
    TARGET_ERROR,
    _load,
    calibrate,
    fit_overlap,
    overlap_points,
    topology_check,
    training_points,
    what_reads_50s,
)
from benchmarks.cost_model.model import (
    GPUS_AXIS,
    HEADLINE,
    IMAGENET_TRAIN,
    VARIANTS,
    predict,
    predict_with_overlap,
    resnet50_sizes,
)
from benchmarks.cost_model.report import (
    assumptions_text,
    calibration_table,
    overlap_tables,
    plot,
    prediction_table,
    sensitivity_table,
    topology_table,
    validation_summary,
    validation_table,
)

REPO_ROOT = harness.REPO_ROOT
DEFAULT_DIR = os.path.join(harness.DEFAULT_OUT, 'cost_model')
# The committed GPU-like runs (docs/benchmarks.md's first table), and the ResNet-50 125/s jobs
# on 2 test hosts at 3 Gbit/s among them to fit h on; the others check it.
DEFAULT_OVERLAP = os.path.join(harness.REPO_ROOT, 'benchmarks', 'results', 'overlap.json')
DEFAULT_FIT_ON = '125/s 22:41,125/s 23:22'


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    parser = harness.parser(DOC)
    parser.add_argument('--measured',
                        help='a grid --scaling JSON with the training measurements to calibrate '
                             'and validate on (default: none, no calibration)')
    parser.add_argument('--calibration', default=None,
                        help='comma-separated grid --scaling JSONs with raw allreduce timings of '
                             'every test bed checked and a 1-rank training job (default: --measured)')
    parser.add_argument('--predict-only', action='store_true',
                        help='the prediction alone: no calibration, validation or learned overlap')
    parser.add_argument('--out', default=DEFAULT_DIR, help='folder for cost_model.{md,json,png}')
    scale = parser.add_argument_group('the prediction at scale (assumptions)')
    scale.add_argument('--gpus', type=int, default=256)
    scale.add_argument('--gpus-per-node', type=int, default=4)
    scale.add_argument('--gpu-images-per-s', type=float, default=125.0,
                       help='ResNet-50 training images/s of one GPU alone (P100 class, fp32)')
    scale.add_argument('--batch-per-gpu', type=int, default=32)
    scale.add_argument('--fwd-share', type=float, default=1 / 3, help='forward share of compute')
    scale.add_argument('--images', type=int, default=IMAGENET_TRAIN, help='images per epoch')
    scale.add_argument('--net-gbit', type=float, default=100.0, help='link a node (EDR InfiniBand)')
    scale.add_argument('--net-efficiency', type=float, default=0.9, help='share of the link MPI reaches')
    scale.add_argument('--net-latency-us', type=float, default=2.0, help='one message step between nodes')
    scale.add_argument('--intra-gbytes', type=float, default=10.0, help='shared memory inside a node')
    scale.add_argument('--intra-latency-us', type=float, default=1.0)
    scale.add_argument('--stage-gbytes', type=float, default=12.0,
                       help='GPU-host copies (PCIe 3 x16) each way; 0: CUDA-aware MPI')
    scale.add_argument('--sigma-us', type=float, default=30.0,
                       help="the store's own cost per collective on a real node")
    scale.add_argument('--kappa-us', type=float, default=20.0,
                       help="the store's cost per array (the Python pushpull call)")
    learned = parser.add_argument_group('overlap learned on GPU-like runs (benchmarks/overlap.py)')
    learned.add_argument('--overlap', default=DEFAULT_OVERLAP,
                         help='comma-separated overlap results (run JSONs or the committed table): '
                              'fit h per schedule, check it, and predict with it')
    learned.add_argument('--fit-on', default=DEFAULT_FIT_ON,
                         help="comma-separated parts of runs' names (file: label) to fit on; the "
                              'others check the fit')
    return parser.parse_args(argv)


def learned_overlap(args):
    """--overlap: h per schedule fitted on GPU-like runs, checked, and the prediction at
    args.gpus with it; -> markdown."""
    paths = [p for p in args.overlap.split(',') if p]
    points = overlap_points(paths)
    fit_on = [n for n in args.fit_on.split(',') if n]
    fitted = fit_overlap(points, fit_on)
    sizes = resnet50_sizes()
    predictions = {c: predict_with_overlap(args, sizes, args.gpus, h) for c, h in fitted.items()}
    checks = [p for p in points if not p['fitted'] and 'step_error' in p]
    worst = max((abs(p['step_error']) for p in checks), default=None)
    text = '\n'.join([
        f'## Overlap learned on GPU-like runs: ResNet-50 on ImageNet-1k, {args.gpus} GPUs', '',
        'h = (compute + exchange - step) / min(compute, exchange), fitted per schedule on '
        + ', '.join(fit_on) + '; step = compute + exchange - h min(compute, exchange). '
        'At scale compute and exchange come from the alpha-beta model (flat, fusion on, '
        'the assumptions above).', '', overlap_tables(points, fitted, predictions), '',
        ('No run outside the fit to check it on.' if worst is None else
         f'Largest error on runs not fitted on: {100 * worst:.1f}% (target '
         f'{100 * TARGET_ERROR:.0f}%).')])
    with open(os.path.join(args.out, 'overlap_model.json'), 'w') as fh:
        json.dump({'points': points, 'fitted': fitted, 'predictions': predictions,
                   'fit_on': fit_on, 'assumptions': vars(args)}, fh, indent=1, default=str)
    return text


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    report = {'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'), 'assumptions': vars(args)}
    md = ['# Cost model (benchmarks/cost_model.py)', '']
    points = []
    if args.measured and not args.predict_only:
        measured = _load(args.measured)
        args.calibration = args.calibration or args.measured
        cal = calibrate([_load(path) for path in args.calibration.split(',')])
        points = training_points(measured, cal)
        report.update(calibration_file=args.calibration, measured_file=args.measured,
                      calibration=cal.as_dict(), validation=points, topology=topology_check(cal))
        md += ['## Calibration (' + ', '.join(os.path.relpath(p, REPO_ROOT)
                                               for p in args.calibration.split(',')) + ')', '',
               calibration_table(cal), '',
               '## Topology: flat against hierarchical', '',
               ('Flat, N ranks N/2 a host carry N/2 times the bytes of 2 ranks over each link: '
               'their allreduce cannot take less than the "flat: link alone" column (the 2-rank '
               'fit times N/2, shared memory free). Hierarchical, the link carries what 2 ranks '
               'carry, and the rest of the time is a reduce-scatter and an allgather inside each '
               'host, whose rate the last column infers. Measured times below the '
               'flat bound, and one inferred rate at every link rate, mean that MPICH reduces '
               'inside the hosts first (it has node-aware allreduce algorithms); the validation '
               'uses each test bed\'s own measured line, so it does not depend on this reading.'), '',
               topology_table(topology_check(cal)), '',
               (f'## Validation against {os.path.relpath(args.measured, REPO_ROOT)} '
               '(overlap h = 0 on the test bed)'), '',
               validation_table(points), '', validation_summary(points), '']
    sizes = resnet50_sizes()
    rows = [(name, predict(args, sizes, args.gpus, h, thr, hier)) for name, h, thr, hier in VARIANTS]
    scale = {'gpus': args.gpus, 'net_gbit': args.net_gbit,
             'by_gpus': {name: [predict(args, sizes, g, h, thr, hier) for g in GPUS_AXIS]
                         for name, h, thr, hier in VARIANTS},
             'by_net': {name: [dict(predict(args, sizes, args.gpus, h, thr, hier, net_gbit=bw), net_gbit=bw)
                               for bw in (1, 3, 10, 25, 56, 100, 200)]
                        for name, h, thr, hier in VARIANTS},
             'by_gpu_speed': {name: [dict(predict(args, sizes, args.gpus, h, thr, hier, gpu_rate=g),
                                          gpu_images_per_s=g)
                                     for g in (60, 125, 250, 500, 1000, 2000)]
                              for name, h, thr, hier in VARIANTS}}
    headline = dict(rows)[HEADLINE]
    readings = what_reads_50s(args, sizes)
    implied = args.images / 50.0 / args.gpus
    md += [f'## Prediction: ResNet-50 on ImageNet-1k, {args.gpus} GPUs', '',
           ('Assumptions (the paper text available here, the arXiv abstract, states the result but '
           'not the GPUs or the network; these are ours):'), ''] + assumptions_text(args, sizes) + [
           '', prediction_table(rows), '',
           (f'Headline ({HEADLINE}): **{headline["epoch_s"]:.0f} s per epoch** '
           f'({headline["images_per_s"]:.0f} images/s, {headline["efficiency"]:.2f} of compute-only '
           f'{headline["epoch_compute_only_s"]:.0f} s). The paper reports about 50 s; 50 s means '
           f'{implied:.0f} images/s per GPU delivered.'), ''] + readings + [
           '', (f'Where overlap, fusion and hierarchy matter: epoch seconds (and compute-only step / '
           f'step) at {args.gpus} GPUs, against the GPU\'s speed (faster GPUs leave less backward '
           'to hide the exchange behind) and the network:'), '',
           sensitivity_table(scale['by_gpu_speed'], 'gpu_images_per_s', 'img/s', lambda v: f'{v:g}'), '',
           sensitivity_table(scale['by_net'], 'net_gbit', 'Gbit/s', lambda v: f'{v:g}'), '']
    report['prediction'] = {'rows': dict(rows), 'by_gpus': scale['by_gpus'], 'by_net': scale['by_net'],
                            'by_gpu_speed': scale['by_gpu_speed'], 'readings_of_50s': readings,
                            'gradient_sizes': sizes}
    if args.overlap and not args.predict_only:
        md += [learned_overlap(args), '']
    md_text = '\n'.join(md) + '\n'
    with open(os.path.join(args.out, 'cost_model.md'), 'w') as handle:
        handle.write(md_text)
    with open(os.path.join(args.out, 'cost_model.json'), 'w') as handle:
        json.dump(report, handle, indent=1, default=str)
    print(md_text)
    print(plot(points, scale, os.path.join(args.out, 'cost_model.png')))
    print(f'written: {args.out}/cost_model.md, cost_model.json')
    return 0


if __name__ == '__main__':
    sys.exit(main())

