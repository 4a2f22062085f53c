//! Collectives: all-reduce time and bandwidth against the machine's memcpy bandwidth, and
//! bucketed against per-parameter all-reduce of a model's gradients.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::{Distribution, Tensor, TensorData};
use burn_ddp::comm::topology::{Topology, TopologySource};
use burn_ddp::group::{ReduceOp, TcpGroupOptions};
use burn_ddp::mechanism::{Reducer, ReducerOptions, ReplicaLayout};
use burn_ddp::{
    ProcessGroup,
    group::{TcpGroup, ThreadGroup},
};
use serde::{Deserialize, Serialize};

use crate::models::{BigMlp, ModelKind};
use crate::training::{B, median};

type Inner = burn::backend::Flex;

/// Which process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GroupKind {
    /// Threads of one process, shared memory.
    Threads,
    /// TCP over loopback (ranks as threads here, so the figure is the protocol's, without
    /// process start-up).
    Tcp,
    /// `MpiGroup`: the processes of `mpirun` (Open MPI, shared memory between them), feature
    /// `mpi`.
    Mpi,
    /// PyTorch's gloo all-reduce on processes over loopback (`python3` with torch), the peer a
    /// user would otherwise pick for CPU training.
    Gloo,
}

impl GroupKind {
    /// Every group, in table order.
    pub const ALL: [GroupKind; 4] = [
        GroupKind::Threads,
        GroupKind::Tcp,
        GroupKind::Mpi,
        GroupKind::Gloo,
    ];

    /// Name in tables.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Threads => "ThreadGroup",
            GroupKind::Tcp => "TcpGroup (loopback)",
            GroupKind::Mpi => "MpiGroup (mpirun)",
            GroupKind::Gloo => "PyTorch gloo",
        }
    }
}

/// One all-reduce size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AllReducePoint {
    /// The group.
    pub group: GroupKind,
    /// Ranks.
    pub world_size: usize,
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Median time of one all-reduce, seconds.
    pub seconds: f64,
    /// `bytes / seconds`, GB/s (nccl-tests' algbw).
    pub algbw_gbps: f64,
    /// `algbw * 2(n-1)/n`, GB/s (nccl-tests' busbw).
    pub busbw_gbps: f64,
}

/// memcpy bandwidth of one buffer size: bytes copied per second, GB/s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemcpyPoint {
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Median GB/s of bytes copied.
    pub gbps: f64,
}

/// Runs `f` repeatedly for at least `budget` (and at least 3 times); the median duration.
fn time(budget: Duration, mut f: impl FnMut() -> Duration) -> f64 {
    let started = Instant::now();
    let mut samples = Vec::new();
    while samples.len() < 3 || (started.elapsed() < budget && samples.len() < 200) {
        samples.push(f().as_secs_f64());
    }
    median(&samples)
}

/// Times `f` on every rank of `group` the same number of times (collectives must be called as
/// often on every rank): one calibration call, then as many as fit in `budget` on the slowest
/// rank (3 to 200); the median duration.
fn time_together(
    group: &dyn ProcessGroup,
    budget: Duration,
    mut f: impl FnMut() -> Duration,
) -> f64 {
    let first = f().as_secs_f64().max(1e-7);
    let wanted = (budget.as_secs_f64() / first).clamp(5.0, 200.0) as u64;
    let count = group
        .all_gather(&[wanted], Duration::from_secs(600))
        .map(|all| all.into_iter().min().unwrap_or(5))
        .unwrap_or(5);
    let samples: Vec<f64> = (0..count).map(|_| f().as_secs_f64()).collect();
    median(&samples)
}

/// `world_size` ranks of `kind`, each running `f(rank, group)` on its own thread.
pub fn with_group<R: Send>(
    kind: GroupKind,
    world_size: usize,
    f: impl Fn(Arc<dyn ProcessGroup>) -> R + Sync,
) -> Vec<R> {
    let groups: Vec<Arc<dyn ProcessGroup>> = match kind {
        GroupKind::Threads => ThreadGroup::new_group(world_size)
            .map(|g| {
                g.into_iter()
                    .map(|g| Arc::new(g) as Arc<dyn ProcessGroup>)
                    .collect()
            })
            .unwrap_or_default(),
        // Other processes' groups: see `external_sweep`.
        GroupKind::Mpi | GroupKind::Gloo => Vec::new(),
        GroupKind::Tcp => {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .unwrap_or(29_777);
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..world_size)
                    .map(|rank| {
                        s.spawn(move || {
                            let topology = Topology {
                                rank,
                                world_size,
                                local_rank: rank,
                                local_world_size: world_size,
                                master_addr: "127.0.0.1".into(),
                                master_port: port,
                                agent_store: false,
                                restart_count: 0,
                                source: TopologySource::Torchrun,
                            };
                            TcpGroup::connect(&topology, &TcpGroupOptions::default())
                                .map(|g| Arc::new(g) as Arc<dyn ProcessGroup>)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .filter_map(|h| h.join().ok().and_then(Result::ok))
                    .collect()
            })
        }
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|group| {
                let f = &f;
                s.spawn(move || f(group))
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    })
}

/// All-reduce (average) of `sizes` bytes on `world_size` ranks of `kind`.
pub fn all_reduce_sweep(
    kind: GroupKind,
    world_size: usize,
    sizes: &[usize],
    budget: Duration,
) -> Vec<AllReducePoint> {
    let per_rank: Vec<Vec<f64>> = with_group(kind, world_size, |group| {
        sweep_rank(group.as_ref(), sizes, budget)
    });
    points(kind, world_size, sizes, &per_rank)
}

/// One rank's part of an all-reduce sweep: the median seconds of an all-reduce (average) of
/// each size, every rank timing the same number of calls.
pub fn sweep_rank(group: &dyn ProcessGroup, sizes: &[usize], budget: Duration) -> Vec<f64> {
    let timeout = Duration::from_secs(600);
    sizes
        .iter()
        .map(|&bytes| {
            let mut buffer = vec![1.0f32; bytes / 4];
            // Start together: otherwise the first all-reduce times the other rank's start.
            let _ = group.barrier(timeout);
            time_together(group, budget, || {
                let started = Instant::now();
                let _ = group.all_reduce(&mut buffer, ReduceOp::Avg, timeout);
                started.elapsed()
            })
        })
        .collect()
}

/// The sweep of every rank (seconds per size) as points: the slowest rank's time.
fn points(
    kind: GroupKind,
    world_size: usize,
    sizes: &[usize],
    per_rank: &[Vec<f64>],
) -> Vec<AllReducePoint> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &bytes)| {
            let seconds = per_rank.iter().map(|r| r[i]).fold(0.0, f64::max);
            let algbw = bytes as f64 / seconds / 1e9;
            AllReducePoint {
                group: kind,
                world_size,
                bytes,
                seconds,
                algbw_gbps: algbw,
                busbw_gbps: algbw * 2.0 * (world_size as f64 - 1.0) / world_size as f64,
            }
        })
        .collect()
}

/// The sweep of a group whose ranks are other processes: `command` prints JSON, either
/// `{"seconds": [...]}` (one median per size, the slowest rank's) or `{"skipped": "why"}`.
/// `Err` says why there are no points.
pub fn external_sweep(
    kind: GroupKind,
    world_size: usize,
    sizes: &[usize],
    mut command: std::process::Command,
) -> Result<Vec<AllReducePoint>, String> {
    #[derive(Deserialize)]
    struct Answer {
        #[serde(default)]
        seconds: Vec<f64>,
        #[serde(default)]
        skipped: Option<String>,
    }
    let output = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| {
            format!(
                "{}: cannot start {:?}: {e}",
                kind.name(),
                command.get_program()
            )
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let answer: Answer = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .ok_or_else(|| {
            format!(
                "{}: no result ({}): {}",
                kind.name(),
                output.status,
                stdout.trim()
            )
        })?;
    if let Some(why) = answer.skipped {
        return Err(format!("{}: skipped: {why}", kind.name()));
    }
    if answer.seconds.len() != sizes.len() {
        return Err(format!(
            "{}: {} results for {} sizes",
            kind.name(),
            answer.seconds.len(),
            sizes.len()
        ));
    }
    Ok(points(kind, world_size, sizes, &[answer.seconds]))
}

/// memcpy of `sizes` bytes (one thread): the roof the all-reduce is compared to.
pub fn memcpy_sweep(sizes: &[usize], budget: Duration) -> Vec<MemcpyPoint> {
    sizes
        .iter()
        .map(|&bytes| {
            let source = vec![1.0f32; bytes / 4];
            let mut target = vec![0.0f32; bytes / 4];
            let seconds = time(budget, || {
                let started = Instant::now();
                target.copy_from_slice(&source);
                std::hint::black_box(&mut target);
                started.elapsed()
            });
            MemcpyPoint {
                bytes,
                gbps: bytes as f64 / seconds / 1e9,
            }
        })
        .collect()
}

/// Per size, the faster of two memcpy sweeps over the same sizes.
pub fn best_of(a: Vec<MemcpyPoint>, b: Vec<MemcpyPoint>) -> Vec<MemcpyPoint> {
    a.into_iter()
        .zip(b)
        .map(|(a, b)| if b.gbps > a.gbps { b } else { a })
        .collect()
}

/// One bucket cap's cost of synchronising a model's gradients.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BucketPoint {
    /// The model.
    pub model: ModelKind,
    /// The group.
    pub group: GroupKind,
    /// The cap in bytes (`None`: one all-reduce per parameter).
    pub cap_bytes: Option<usize>,
    /// Buckets in the layout.
    pub buckets: usize,
    /// Median time of one gradient synchronisation (flatten, all-reduce, unflatten), ms.
    pub milliseconds: f64,
    /// Mean split of one synchronisation on rank 0, ms: gradients into buckets, all-reduce,
    /// buckets back into gradients (the reducer's own counters).
    pub split_ms: [f64; 3],
}

/// The layout of a new model of `kind` (its parameter ids are new too).
fn layout(kind: ModelKind) -> ReplicaLayout {
    let device = Default::default();
    match kind {
        ModelKind::Cnn => ReplicaLayout::of(&fashion_mnist::model::Cnn::<B>::new(&device)),
        ModelKind::Mlp => ReplicaLayout::of(&BigMlp::<B>::new(&device)),
        ModelKind::MlpFrozen => ReplicaLayout::of(&BigMlp::<B>::new(&device).frozen_half()),
    }
}

/// The ids and shapes of a layout's parameters.
fn parameters(layout: &ReplicaLayout) -> Vec<(ParamId, Vec<usize>)> {
    layout
        .parameters()
        .map(|spec| (spec.id, spec.shape.clone()))
        .collect()
}

/// Random values for gradients of those shapes, made once (drawing 5.8 M random numbers takes
/// longer than the synchronisation being timed).
fn gradient_values(params: &[(ParamId, Vec<usize>)]) -> Vec<TensorData> {
    let device = Default::default();
    params
        .iter()
        .map(|(_, shape)| {
            let numel: usize = shape.iter().product();
            Tensor::<Inner, 1>::random([numel], Distribution::Default, &device).into_data()
        })
        .collect()
}

/// Fresh gradients with `values` (on the inner backend, as burn-train hands them over: each
/// tensor owns its storage).
fn gradients(params: &[(ParamId, Vec<usize>)], values: &[TensorData]) -> GradientsParams {
    let device = Default::default();
    let mut grads = GradientsParams::new();
    for ((id, shape), data) in params.iter().zip(values) {
        let flat = Tensor::<Inner, 1>::from_data(data.clone(), &device);
        match shape.len() {
            1 => grads.register::<Inner, 1>(*id, flat),
            2 => grads.register::<Inner, 2>(*id, flat.reshape([shape[0], shape[1]])),
            3 => grads.register::<Inner, 3>(*id, flat.reshape([shape[0], shape[1], shape[2]])),
            _ => grads
                .register::<Inner, 4>(*id, flat.reshape([shape[0], shape[1], shape[2], shape[3]])),
        }
    }
    grads
}

/// The reducer's time per synchronisation for each cap (and per parameter), on 2 ranks.
pub fn bucket_sweep(
    kind: ModelKind,
    group: GroupKind,
    caps_mib: &[usize],
    budget: Duration,
) -> Vec<BucketPoint> {
    // The gradients must carry the layout's parameter ids, or the reducer finds none of them.
    let model = layout(kind);
    let params = parameters(&model);
    // `None`: a cap of one byte closes a bucket after every parameter.
    let caps: Vec<Option<usize>> = std::iter::once(None)
        .chain(caps_mib.iter().map(|mib| Some(mib << 20)))
        .collect();
    let results: Vec<Vec<(usize, f64, [f64; 3])>> = with_group(group, 2, |group| {
        caps.iter()
            .map(|cap| {
                let bytes = cap.unwrap_or(1);
                let options = ReducerOptions {
                    bucket_cap_bytes: bytes,
                    first_bucket_cap_bytes: bytes,
                    ..ReducerOptions::default()
                };
                let Ok(mut reducer) = Reducer::new(group.clone(), &model, &options) else {
                    return (0, f64::NAN, [f64::NAN; 3]);
                };
                let buckets = reducer.layout().buckets().len();
                let values = gradient_values(&params);
                let seconds = time_together(group.as_ref(), budget, || {
                    let grads = gradients(&params, &values);
                    // Start together, or one rank's timing includes the other's preparation.
                    let _ = group.barrier(Duration::from_secs(600));
                    let started = Instant::now();
                    let reduced = reducer.reduce::<Inner>(&model, grads, &Default::default());
                    let elapsed = started.elapsed();
                    match &reduced {
                        Err(e) => eprintln!("ddp-bench: bucket sweep: {e}"),
                        Ok(g) if g.len() != params.len() => eprintln!(
                            "ddp-bench: bucket sweep: {} of {} gradients came back",
                            g.len(),
                            params.len()
                        ),
                        Ok(_) => {}
                    }
                    // Freed outside the timing, as burn-train frees gradients after the step.
                    drop(reduced);
                    elapsed
                });
                let stats = reducer.stats();
                let per_step = |d: Duration| d.as_secs_f64() * 1e3 / stats.steps.max(1) as f64;
                let split = [
                    per_step(stats.flatten),
                    per_step(stats.all_reduce),
                    per_step(stats.unflatten),
                ];
                (buckets, seconds, split)
            })
            .collect()
    });
    caps.iter()
        .enumerate()
        .map(|(i, cap)| BucketPoint {
            model: kind,
            group,
            cap_bytes: *cap,
            buckets: results.first().map_or(0, |r| r[i].0),
            milliseconds: results.iter().map(|r| r[i].1).fold(0.0, f64::max) * 1e3,
            split_ms: results.first().map_or([f64::NAN; 3], |r| r[i].2),
        })
        .collect()
}

/// Gradient bytes per step of a model (`f32`).
pub fn gradient_bytes(kind: ModelKind) -> usize {
    parameters(&layout(kind))
        .iter()
        .map(|(_, shape)| shape.iter().product::<usize>() * 4)
        .sum()
}
