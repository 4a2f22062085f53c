//! Fashion-MNIST on N replicas with burn-ddp.
//!
//! `cargo xtask example fashion-mnist -- --workers 2 --epochs 2` trains the CNN of
//! [`model`] on two replicas (two threads on CPU) and prints, per epoch, the train loss, the test
//! accuracy and the training throughput, then each rank's time in communication.
//! `--workers 1` trains with plain Burn on one device, the reference. Under the launcher
//! (`burn-ddp run --nproc-per-node N -- fashion-mnist ...`) each process is one replica.

mod printer;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use burn::backend::{Autodiff, Flex, NdArray};
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::AdamConfig;
use burn::record::CompactRecorder;
use burn::tensor::backend::AutodiffBackend;
use burn::train::logger::InMemoryMetricLogger;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{ExecutionStrategy, Learner, SupervisedTraining};
use burn_ddp::advanced::Topology;
use burn_ddp::checkpoint::AtomicRecorder;
use burn_ddp::group::TcpGroupOptions;
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler,
    TcpGroup,
};
use clap::{Parser, ValueEnum};

use fashion_mnist::data::{self, FashionBatcher, FashionItem};
use fashion_mnist::model::Cnn;

/// Train a CNN on Fashion-MNIST with data parallelism (burn-ddp).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Replicas (one thread each on CPU, one per GPU on CUDA); 1 trains with plain Burn. Default:
    /// 2 on CPU, every visible GPU on CUDA. Under `burn-ddp run` (RANK and WORLD_SIZE set) each
    /// process is one replica and this is ignored.
    #[arg(long)]
    workers: Option<usize>,
    /// Train through burn-ddp's DdpStrategy even with one replica (to measure its overhead
    /// against plain Burn, which `--workers 1` uses otherwise).
    #[arg(long)]
    ddp: bool,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Global batch size (samples per optimizer step over all replicas); must divide by --workers.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Seed of the initial weights and of the data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Learning rate of Adam.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Directory with the four IDX files (default: $FASHION_MNIST_DIR, the Debian package, the
    /// cache, a download).
    #[arg(long)]
    data: Option<PathBuf>,
    /// CPU backend.
    #[arg(long, value_enum, default_value_t = CpuBackend::Flex)]
    backend: CpuBackend,
    /// Device kind.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// Train on the first N images only (quick runs); the test set stays whole.
    #[arg(long)]
    train_limit: Option<usize>,
    /// Directory for burn-train's logs, metrics and checkpoints.
    #[arg(long, default_value = "target/fashion-mnist")]
    artifacts: PathBuf,
    /// Write a checkpoint after every epoch (always on under `burn-ddp run`, so restarts resume).
    #[arg(long)]
    checkpoint: bool,
    /// Resume from the newest complete checkpoint in ARTIFACTS/checkpoint (automatic after a
    /// restart by `burn-ddp run --max-restarts`): an epoch checkpoint, or a step checkpoint
    /// written when the job was stopped by SIGTERM/SIGINT; a truncated one is passed over.
    #[arg(long)]
    resume: bool,
    /// Also write a step checkpoint every N optimizer steps (0: only at the end of epochs and on
    /// SIGTERM/SIGINT).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CpuBackend {
    /// burn-flex (measured faster on this model, see README).
    Flex,
    /// burn-ndarray.
    Ndarray,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum DeviceKind {
    /// The CPU backend chosen by --backend.
    Cpu,
    /// CUDA GPUs (build with `--features cuda`).
    Cuda,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,burn_ddp=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    match run_with_backend(&args) {
        Ok(()) => ExitCode::SUCCESS,
        // Stopped by SIGTERM/SIGINT after the checkpoint of the step reached: the documented
        // exit code, which `burn-ddp run` does not treat as a failure.
        Err(Failure::Stopped(message)) => {
            eprintln!("{message}");
            ExitCode::from(burn_ddp::PREEMPTED_EXIT_CODE as u8)
        }
        Err(Failure::Other(message)) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Why the example ended early.
enum Failure {
    /// Stopped by a signal after a checkpoint.
    Stopped(String),
    /// Anything else.
    Other(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Other(message)
    }
}

/// Where this process's replicas run: threads of this process (`--workers`), or one replica in
/// each process of a job started by `burn-ddp run`, torchrun, srun or mpirun.
enum Job {
    Threads(usize),
    Process(Topology),
}

impl Job {
    fn world_size(&self) -> usize {
        match self {
            Job::Threads(n) => *n,
            Job::Process(t) => t.world_size,
        }
    }

    fn rank(&self) -> usize {
        match self {
            Job::Threads(_) => 0,
            Job::Process(t) => t.rank,
        }
    }

    /// The local replicas' device indices (GPU ordinals on CUDA).
    fn local_devices(&self) -> Vec<usize> {
        match self {
            Job::Threads(n) => (0..*n).collect(),
            Job::Process(t) => vec![t.local_rank],
        }
    }
}

fn run_with_backend(args: &Args) -> Result<(), Failure> {
    let job = match Topology::from_env().map_err(|e| e.to_string())? {
        Some(topology) => Job::Process(topology),
        None => Job::Threads(workers(args)?),
    };
    if !args.batch_size.is_multiple_of(job.world_size()) {
        return Err(Failure::Other(format!(
            "--batch-size {} does not divide between {} replicas: the global batch is split evenly",
            args.batch_size,
            job.world_size()
        )));
    }
    // One CPU device: every replica uses it (one thread each).
    match (args.device, args.backend) {
        (DeviceKind::Cpu, CpuBackend::Flex) => {
            train::<Autodiff<Flex>>(args, &job, |_| Default::default())
        }
        (DeviceKind::Cpu, CpuBackend::Ndarray) => {
            train::<Autodiff<NdArray>>(args, &job, |_| Default::default())
        }
        (DeviceKind::Cuda, _) => cuda(args, &job),
    }
}

/// The replicas of this process: `--workers`, or 2 on CPU and every visible GPU on CUDA.
fn workers(args: &Args) -> Result<usize, String> {
    let workers = match (args.workers, args.device) {
        (Some(workers), _) => workers,
        (None, DeviceKind::Cpu) => 2,
        (None, DeviceKind::Cuda) => cuda_devices()?,
    };
    if workers == 0 {
        return Err("--workers must be at least 1".into());
    }
    if args.device == DeviceKind::Cuda {
        // NCCL puts one rank per GPU.
        let gpus = cuda_devices()?;
        if workers > gpus {
            return Err(format!(
                "--workers {workers} but {gpus} CUDA device(s) visible: one replica per GPU"
            ));
        }
    }
    Ok(workers)
}

#[cfg(feature = "cuda")]
fn cuda_devices() -> Result<usize, String> {
    burn_ddp::nccl::cuda_device_count().map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn cuda_devices() -> Result<usize, String> {
    Err(NO_CUDA.into())
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "this binary was built without CUDA: rebuild with `--features cuda` \
     (cargo xtask example fashion-mnist --features cuda -- --device cuda)";

#[cfg(feature = "cuda")]
fn cuda(args: &Args, job: &Job) -> Result<(), Failure> {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    // A clear error instead of a panic in Burn when there is no NVIDIA driver or NVRTC.
    burn_ddp::nccl::check_cuda_driver().map_err(|e| e.to_string())?;
    let gpus = cuda_devices()?;
    let index = match job {
        Job::Threads(_) => None,
        // One process per GPU: its local rank, or the one GPU a scheduler left visible to it
        // (CUDA_VISIBLE_DEVICES set per task, as Slurm does).
        Job::Process(topology) if topology.local_rank < gpus => None,
        Job::Process(_) if gpus == 1 => Some(0),
        Job::Process(topology) => {
            return Err(Failure::Other(format!(
                "local rank {} has no GPU: {gpus} CUDA device(s) visible; run one process per GPU",
                topology.local_rank
            )));
        }
    };
    train::<Autodiff<Cuda>>(args, job, |i| CudaDevice::new(index.unwrap_or(i)))
}

#[cfg(not(feature = "cuda"))]
fn cuda(_args: &Args, _job: &Job) -> Result<(), Failure> {
    Err(Failure::Other(NO_CUDA.into()))
}

fn train<B: AutodiffBackend>(
    args: &Args,
    job: &Job,
    device_of: impl Fn(usize) -> B::Device,
) -> Result<(), Failure> {
    let rank = job.rank();
    let world_size = job.world_size();
    let devices: Vec<B::Device> = job.local_devices().into_iter().map(device_of).collect();
    let dataset = data::load(args.data.as_deref()).map_err(|e| e.to_string())?;
    let mut train_items = dataset.train;
    if let Some(limit) = args.train_limit {
        train_items.truncate(limit);
    }
    if rank == 0 {
        println!(
            "Fashion-MNIST from {}: {} training images, {} test images; {} replica(s) as {}, global batch {}, {} backend",
            dataset.source.display(),
            train_items.len(),
            dataset.test.len(),
            world_size,
            match job {
                Job::Threads(_) => "threads",
                Job::Process(_) => "processes",
            },
            args.batch_size,
            match args.device {
                DeviceKind::Cuda => "cuda",
                DeviceKind::Cpu => match args.backend {
                    CpuBackend::Flex => "flex",
                    CpuBackend::Ndarray => "ndarray",
                },
            }
        );
    }

    let device = devices[0].clone();
    B::seed(&device, args.seed);
    let model = Cnn::<B>::new(&device);
    // Burn creates parameters lazily; create them now, from the seed, on this thread.
    let _ = burn_ddp::advanced::value_fingerprint(&model);

    // Resume from the newest complete checkpoint when asked, or when the launcher restarted us.
    let restarted = std::env::var(burn_ddp::advanced::topology::RESTART_COUNT_VAR)
        .is_ok_and(|count| count != "0");
    let resume = args.resume || restarted;

    let train_len = train_items.len();
    let sampler = DistributedSampler::new(train_len, world_size)
        .map_err(|e| e.to_string())?
        .with_seed(args.seed);
    let train_loader: Arc<dyn DataLoader<B, data::FashionBatch<B>>> = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(train_items)),
            FashionBatcher,
            sampler,
            args.batch_size / world_size,
            device.clone(),
        )
        // No `with_epoch` on resume: under DdpStrategy the loader follows burn-train's epoch.
        .map_err(|e| e.to_string())?,
    );
    let test_loader = DataLoaderBuilder::new(FashionBatcher)
        .batch_size(256)
        .set_device(device.clone())
        .build(InMemDataset::<FashionItem>::new(dataset.test));

    let learner = Learner::new(model, AdamConfig::new().init(), args.lr);
    // Every rank reads checkpoints from the same directory; only rank 0 writes them and logs
    // metrics there (the others keep their, empty, metric logs in memory).
    let mut training = SupervisedTraining::new(&args.artifacts, train_loader, test_loader)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(args.epochs)
        .renderer(printer::EpochPrinter::new(rank == 0))
        .with_application_logger(None);
    if rank != 0 {
        training = training.with_metric_logger(InMemoryMetricLogger::new());
    }
    let checkpoints = args.checkpoint || resume || job_restartable();
    if checkpoints {
        // Atomic: a checkpoint file is the old one or the complete new one, never half written.
        training = training.with_file_checkpointer(AtomicRecorder::new(CompactRecorder::new()));
    }
    // Step checkpoints (SIGTERM/SIGINT, --checkpoint-every) and the resume go to the same place
    // as burn-train's epoch checkpoints.
    let config = DdpConfig::default()
        .with_checkpoint_dir(args.artifacts.join("checkpoint"))
        .with_resume(resume)
        .with_checkpoint_every(args.checkpoint_every);

    let strategy = match job {
        Job::Threads(1) if !args.ddp => {
            training
                .with_training_strategy(ExecutionStrategy::SingleDevice(device).into())
                .launch(learner);
            return Ok(());
        }
        Job::Threads(_) => DdpStrategy::new(devices),
        Job::Process(topology) => {
            let group = TcpGroup::connect(topology, &TcpGroupOptions::default())
                .map_err(|e| e.to_string())?;
            DdpStrategy::with_process_group(device, Arc::new(group))
        }
    }
    .with_config(config);
    let handle = strategy.clone();
    match training.launch_ddp(learner, strategy) {
        Ok(_) => {}
        Err(e @ DdpError::Preempted { .. }) => return Err(Failure::Stopped(e.to_string())),
        Err(e) => return Err(Failure::Other(format!("training failed: {e}"))),
    }
    let report = handle.report();
    if report.ranks.is_empty() || (rank != 0 && matches!(job, Job::Process(_))) {
        return Ok(());
    }
    println!("time per rank (forward+backward / gradient sync incl. waiting / optimizer):");
    for rank in &report.ranks {
        println!(
            "  rank {}: {} batches, compute {:.1} s, communication {:.2} s ({:.1} MiB all-reduced, \
             {:.2} s in all-reduce, {:.2} s agreement; {:.2} collectives per step), optimizer \
             {:.2} s",
            rank.rank,
            rank.batches,
            rank.compute.as_secs_f64(),
            (rank.comm.total() + rank.coordination).as_secs_f64(),
            rank.comm.bytes as f64 / (1024.0 * 1024.0),
            rank.comm.all_reduce.as_secs_f64(),
            rank.coordination.as_secs_f64(),
            rank.collectives_per_step(),
            rank.optimizer.as_secs_f64(),
        );
    }
    Ok(())
}

/// Whether a launcher may restart this job (then checkpoints are written so it can resume).
fn job_restartable() -> bool {
    std::env::var(burn_ddp::advanced::topology::LAUNCHER_VAR).is_ok()
}
