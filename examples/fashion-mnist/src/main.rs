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
use burn::data::dataloader::DataLoader;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamConfig;
use burn::record::CompactRecorder;
use burn::tensor::backend::AutodiffBackend;
use burn::train::logger::FileMetricLogger;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{ExecutionStrategy, Learner, SupervisedTraining};
use burn_ddp::checkpoint::AtomicRecorder;
use burn_ddp::metrics::{MainProcessLogger, MainProcessRenderer};
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler,
};
use clap::{Parser, ValueEnum};

use fashion_mnist::data::{self, FashionBatcher, FashionItem};
use fashion_mnist::model::Cnn;

/// Train a CNN on Fashion-MNIST with data parallelism (burn-ddp).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Replicas (one thread each on CPU, one per GPU on CUDA); 1 trains with plain Burn. Default:
    /// 2 on CPU, every visible GPU on CUDA. Under `burn-ddp run`, srun or mpirun each process is
    /// one replica and this is ignored (the launcher's process count is the number of replicas).
    #[arg(long)]
    workers: Option<usize>,
    /// Train through burn-ddp's DdpStrategy even with one replica (to measure its overhead
    /// against plain Burn, which `--workers 1` uses otherwise).
    #[arg(long)]
    ddp: bool,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    /// Global batch size (samples per optimizer step over all replicas); must divide by the number
    /// of replicas (--workers, or the launcher's process count).
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
    /// Directory for burn-train's logs, metrics and checkpoints; a run without `--resume`
    /// replaces an earlier run's checkpoints there (burn-ddp prints whose).
    #[arg(long, default_value = "target/fashion-mnist")]
    artifacts: PathBuf,
    /// Write a checkpoint after every epoch (always on under `burn-ddp run`, so restarts resume).
    #[arg(long)]
    checkpoint: bool,
    /// Resume from the newest complete checkpoint in ARTIFACTS/checkpoint, whichever run wrote
    /// it (a restart by `burn-ddp run --max-restarts` resumes its own run's by itself): an epoch
    /// checkpoint, or a step checkpoint written when the job was stopped by SIGTERM/SIGINT; a
    /// truncated one is passed over.
    #[arg(long)]
    resume: bool,
    /// Also write a step checkpoint every N optimizer steps (0: only at the end of epochs and on
    /// SIGTERM/SIGINT).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Background threads per replica that build the next batches (PyTorch's `num_workers`).
    #[arg(long, default_value_t = 0)]
    loader_workers: usize,
    /// With `--device wgpu`: put every replica on this Vulkan adapter (an index of the list
    /// the error for a wrong one prints); default: replica r on adapter r, round robin.
    #[arg(long)]
    adapter: Option<usize>,
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
    /// GPUs through Burn's wgpu backend and Vulkan (build with `--features wgpu`): AMD, Intel,
    /// NVIDIA, or Mesa's software device (lavapipe) where there is no GPU.
    Wgpu,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // burn_ddp_comm::log's events are printed to the console by burn-ddp already.
                .unwrap_or_else(|_| "warn,burn_ddp=info,burn_ddp_comm::log=off".into()),
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
            ExitCode::from(burn_ddp::checkpoint::PREEMPTED_EXIT_CODE as u8)
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

fn run_with_backend(args: &Args) -> Result<(), Failure> {
    // One CPU device repeated: one replica (thread) each. Under a launcher each process is one
    // replica and DdpStrategy::from_env uses the one device.
    let cpu = args.workers.unwrap_or(2);
    if cpu == 0 {
        return Err(Failure::Other("--workers must be at least 1".into()));
    }
    match (args.device, args.backend) {
        (DeviceKind::Cpu, CpuBackend::Flex) => {
            train::<Autodiff<Flex>>(args, vec![Default::default(); cpu])
        }
        (DeviceKind::Cpu, CpuBackend::Ndarray) => {
            train::<Autodiff<NdArray>>(args, vec![Default::default(); cpu])
        }
        (DeviceKind::Cuda, _) => cuda(args),
        (DeviceKind::Wgpu, _) => wgpu(args),
    }
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(_args: &Args) -> Result<(), Failure> {
    Err(Failure::Other(
        "this binary was built without wgpu: rebuild with `--features wgpu` (cargo xtask example \
         fashion-mnist -- --device wgpu adds it)"
            .into(),
    ))
}

/// Replicas on the Vulkan adapters (`--workers`, default 2: threads; under a launcher the
/// process's own, by local rank), round robin when there are fewer adapters than replicas (Mesa's
/// software device is one adapter), or all on `--adapter`.
#[cfg(feature = "wgpu")]
fn wgpu(args: &Args) -> Result<(), Failure> {
    use burn::backend::Wgpu;
    let adapters = fashion_mnist::devices::wgpu_adapters();
    if adapters.is_empty() {
        return Err(Failure::Other(fashion_mnist::devices::NO_VULKAN.into()));
    }
    let chosen = match args.adapter {
        Some(index) => vec![
            adapters
                .get(index)
                .cloned()
                .ok_or_else(|| fashion_mnist::devices::no_such_adapter(index, &adapters))?,
        ],
        None => adapters,
    };
    let workers = args.workers.unwrap_or(2);
    if workers == 0 {
        return Err(Failure::Other("--workers must be at least 1".into()));
    }
    let devices = (0..workers)
        .map(|w| chosen[w % chosen.len()].device.clone())
        .collect();
    train::<Autodiff<Wgpu>>(args, devices)
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "this binary was built without CUDA: rebuild with `--features cuda` \
     (cargo xtask example fashion-mnist --features cuda -- --device cuda)";

/// Every visible GPU (or the first `--workers`): one replica each as threads; under a launcher,
/// DdpStrategy::from_env takes the process's GPU by local rank (or the only visible one).
#[cfg(feature = "cuda")]
fn cuda(args: &Args) -> Result<(), Failure> {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    // A clear error instead of a panic in Burn when there is no NVIDIA driver or NVRTC.
    burn_ddp::comm::group::nccl::check_cuda_driver().map_err(|e| e.to_string())?;
    let gpus = burn_ddp::comm::group::nccl::cuda_device_count().map_err(|e| e.to_string())?;
    let workers = args.workers.unwrap_or(gpus);
    if workers == 0 || workers > gpus {
        return Err(Failure::Other(format!(
            "--workers {workers} but {gpus} CUDA device(s) visible: one replica per GPU"
        )));
    }
    train::<Autodiff<Cuda>>(args, (0..workers).map(CudaDevice::new).collect())
}

#[cfg(not(feature = "cuda"))]
fn cuda(_args: &Args) -> Result<(), Failure> {
    Err(Failure::Other(NO_CUDA.into()))
}

fn train<B: AutodiffBackend>(args: &Args, devices: Vec<B::Device>) -> Result<(), Failure> {
    // Plain Burn on one device (the reference), unless --ddp or a launcher started us.
    let plain = devices.len() == 1 && !args.ddp && burn_ddp::world_size() == 1;
    // The one call: threads without launcher variables, this process's rank (its device, its
    // connected process group, a restart noticed) under `burn-ddp run`, srun, mpirun.
    let strategy = if plain {
        None
    } else {
        Some(DdpStrategy::from_env(devices.clone()).map_err(|e| e.to_string())?)
    };
    let world_size = strategy.as_ref().map_or(1, DdpStrategy::world_size);
    let multi_process = strategy.as_ref().is_some_and(DdpStrategy::is_multi_process);
    if !args.batch_size.is_multiple_of(world_size) {
        return Err(Failure::Other(format!(
            "--batch-size {} does not divide between {world_size} replicas: the global batch is \
             split evenly",
            args.batch_size
        )));
    }
    let device = devices[0].clone();
    let dataset = data::load(args.data.as_deref()).map_err(|e| e.to_string())?;
    let mut train_items = dataset.train;
    if let Some(limit) = args.train_limit {
        train_items.truncate(limit);
    }
    if burn_ddp::is_main_process() {
        println!(
            "Fashion-MNIST from {}: {} training images, {} test images; {} replica(s) as {}, global batch {}, {} backend",
            dataset.source.display(),
            train_items.len(),
            dataset.test.len(),
            world_size,
            if multi_process {
                "processes"
            } else {
                "threads"
            },
            args.batch_size,
            match args.device {
                DeviceKind::Cuda => "cuda",
                DeviceKind::Wgpu => "wgpu",
                DeviceKind::Cpu => match args.backend {
                    CpuBackend::Flex => "flex",
                    CpuBackend::Ndarray => "ndarray",
                },
            }
        );
    }

    B::seed(&device, args.seed);
    let model = Cnn::<B>::new(&device);
    // Burn creates parameters lazily; create them now, from the seed, on this thread.
    let _ = burn_ddp::mechanism::value_fingerprint(&model);

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
        .map_err(|e| e.to_string())?
        .with_num_workers(args.loader_workers),
    );
    // Validation in one fixed order (a sampler of world size 1, unshuffled), which every process
    // can rebuild: burn-ddp shares one device's validation batches out across the ranks, in
    // threads and in processes alike (a Burn `DataLoaderBuilder` loader validates on rank 0
    // alone between processes).
    let test_len = dataset.test.len();
    let test_loader: Arc<dyn DataLoader<B::InnerBackend, data::FashionBatch<B::InnerBackend>>> =
        Arc::new(
            DistributedDataLoader::new(
                Arc::new(InMemDataset::<FashionItem>::new(dataset.test)),
                FashionBatcher,
                DistributedSampler::new(test_len, 1)
                    .map_err(|e| e.to_string())?
                    .without_shuffle(),
                256,
                device.clone(),
            )
            .map_err(|e| e.to_string())?,
        );

    let learner = Learner::new(model, AdamConfig::new().init(), args.lr);
    // Every rank reads checkpoints from the same directory; only rank 0 renders, logs metrics
    // and writes checkpoints.
    let mut training = SupervisedTraining::new(&args.artifacts, train_loader, test_loader)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(args.epochs)
        .renderer(MainProcessRenderer::new(printer::EpochPrinter::new()))
        .with_metric_logger(MainProcessLogger::new(FileMetricLogger::new(
            &args.artifacts,
        )))
        .with_application_logger(None);
    // Under a launcher a restart resumes, so checkpoints are always written there.
    if args.checkpoint || args.resume || multi_process {
        // Atomic: a checkpoint file is the old one or the complete new one, never half written.
        training = training.with_file_checkpointer(AtomicRecorder::new(CompactRecorder::new()));
    }
    let Some(strategy) = strategy else {
        training
            .with_training_strategy(ExecutionStrategy::SingleDevice(device).into())
            .launch(learner);
        return Ok(());
    };
    // Step checkpoints (SIGTERM/SIGINT, --checkpoint-every) and the resume go to the same place
    // as burn-train's epoch checkpoints; a restart by the launcher resumes by itself.
    let checkpoints = args.artifacts.join("checkpoint");
    let mut config = DdpConfig::default()
        .with_checkpoint_dir(&checkpoints)
        .with_checkpoint_every(args.checkpoint_every);
    if args.resume {
        // You point at the directory: its newest checkpoint, whichever run wrote it.
        config = config.with_resume_from(&checkpoints);
    } else {
        // A fresh run of this example starts over in its artifact directory, as Burn's own
        // examples do (they delete it): it replaces an earlier run's epoch checkpoints there,
        // and burn-ddp says whose. Without this, burn-ddp refuses to overwrite another run's.
        config = config.with_overwrite_checkpoints(true);
    }
    // burn-ddp prints its report (samples/s, time per rank) at the end of training.
    match training.launch_ddp(learner, strategy.with_config(config)) {
        Ok(_) => Ok(()),
        Err(e @ DdpError::Preempted { .. }) => Err(Failure::Stopped(e.to_string())),
        Err(e) => Err(Failure::Other(format!("training failed: {e}"))),
    }
}
