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

use burn::data::dataloader::DataLoader;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamConfig;
use burn::tensor::Device;
use burn::train::logger::FileMetricLogger;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{ExecutionStrategy, Learner, SupervisedTraining};
use burn_ddp::metrics::{MainProcessLogger, MainProcessRenderer};
use burn_ddp::{
    DdpConfig, DdpError, DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler,
};
use clap::{Parser, ValueEnum};

use fashion_mnist::data::{self, FashionBatch, FashionBatcher, FashionItem};
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
    /// Device kind.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// Train on the first N images only (quick runs).
    #[arg(long)]
    train_limit: Option<usize>,
    /// Validate on the first N test images only (quick runs; default: all 10,000).
    #[arg(long)]
    test_limit: Option<usize>,
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
    /// truncated one is passed over. With plain Burn (`--workers 1`): the newest epoch
    /// checkpoint, through burn-train's `checkpoint(epoch)`.
    #[arg(long)]
    resume: bool,
    /// Also write a step checkpoint every N optimizer steps (0: only at the end of epochs and on
    /// SIGTERM/SIGINT).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Background threads per replica that build the next batches (PyTorch's `num_workers`).
    #[arg(long, default_value_t = 0)]
    loader_workers: usize,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum DeviceKind {
    /// Burn's CPU backend, Flex (one thread per replica).
    Cpu,
    /// CUDA GPUs (build with `--features cuda`).
    Cuda,
    /// GPUs through Burn's wgpu backend and Vulkan: not yet on Burn 0.22 (the root crate's
    /// example, on Burn 0.21, has it).
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
    if args.device == DeviceKind::Cpu && std::env::var_os("BURN_DEVICE").is_none() {
        // Burn 0.22 loads an optimizer state (a resume, burn-ddp's read-back of an epoch
        // checkpoint) onto its default device, which is CUDA in a build with CUDA: keep it on
        // the CPU device this run trains on.
        // SAFETY: no other thread runs yet (nothing has been started but the logger).
        unsafe { std::env::set_var("BURN_DEVICE", "flex") };
    }
    match devices(&args).and_then(|devices| train(&args, devices)) {
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

/// The replicas' devices, with autodiff (burn-train trains on an autodiff device): on CPU, the
/// one Flex device repeated (one replica, a thread, each); under a launcher each process is one
/// replica and `DdpStrategy::from_env` takes the one device (or its own by local rank).
fn devices(args: &Args) -> Result<Vec<Device>, Failure> {
    match args.device {
        DeviceKind::Cpu => {
            let workers = args.workers.unwrap_or(2);
            if workers == 0 {
                return Err(Failure::Other("--workers must be at least 1".into()));
            }
            Ok(vec![Device::flex().autodiff(); workers])
        }
        DeviceKind::Cuda => cuda(args),
        DeviceKind::Wgpu => Err(Failure::Other(
            "--device wgpu is not yet ported to Burn 0.22 (the Burn 0.21 build of this example \
             has it): use --device cpu or --device cuda"
                .into(),
        )),
    }
}

/// Every visible GPU (or the first `--workers`): one replica each as threads; under a launcher,
/// DdpStrategy::from_env takes the process's GPU by local rank (or the only visible one).
#[cfg(feature = "cuda")]
fn cuda(args: &Args) -> Result<Vec<Device>, Failure> {
    // A clear error instead of a panic in Burn when there is no NVIDIA driver or NVRTC.
    burn_ddp::comm::group::nccl::check_cuda_driver().map_err(|e| e.to_string())?;
    let gpus = burn_ddp::comm::group::nccl::cuda_device_count().map_err(|e| e.to_string())?;
    let workers = args.workers.unwrap_or(gpus);
    if workers == 0 || workers > gpus {
        return Err(Failure::Other(format!(
            "--workers {workers} but {gpus} CUDA device(s) visible: one replica per GPU"
        )));
    }
    Ok((0..workers)
        .map(|index| Device::cuda(index).autodiff())
        .collect())
}

#[cfg(not(feature = "cuda"))]
fn cuda(_args: &Args) -> Result<Vec<Device>, Failure> {
    Err(Failure::Other(
        "this binary was built without CUDA: rebuild with `--features cuda`".into(),
    ))
}

fn train(args: &Args, devices: Vec<Device>) -> Result<(), Failure> {
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
    let mut test_items = dataset.test;
    if let Some(limit) = args.test_limit {
        test_items.truncate(limit);
    }
    if burn_ddp::is_main_process() {
        println!(
            "Fashion-MNIST from {}: {} training images, {} test images; {} replica(s) as {}, global batch {}, {} backend",
            dataset.source.display(),
            train_items.len(),
            test_items.len(),
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
                DeviceKind::Cpu => "flex",
            }
        );
    }

    device.seed(args.seed);
    let model = Cnn::new(&device);
    // Burn creates parameters lazily; create them now, from the seed, on this thread.
    let _ = burn_ddp::mechanism::value_fingerprint(&model);

    // Plain Burn resumes through burn-train's `checkpoint(epoch)`: the newest complete epoch,
    // whose sampler epoch the loader continues from (under DdpStrategy burn-ddp finds the
    // checkpoint and the loader follows burn-train's epoch by itself).
    let checkpoints = args.artifacts.join("checkpoint");
    let plain_resume = match (plain && args.resume, newest_epoch_checkpoint(&checkpoints)) {
        (false, _) => None,
        (true, Some(epoch)) => Some(epoch),
        (true, None) => {
            return Err(Failure::Other(format!(
                "--resume: no complete epoch checkpoint (model-, optim- and \
                 scheduler-<epoch>.bpk) in {}",
                checkpoints.display()
            )));
        }
    };
    let train_len = train_items.len();
    let sampler = DistributedSampler::new(train_len, world_size)
        .map_err(|e| e.to_string())?
        .with_seed(args.seed);
    let train_loader: Arc<dyn DataLoader<FashionBatch>> = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(train_items)),
            FashionBatcher,
            sampler,
            args.batch_size / world_size,
            device.clone(),
        )
        .map_err(|e| e.to_string())?
        .with_epoch(plain_resume.unwrap_or(0) as u64)
        .with_num_workers(args.loader_workers),
    );
    // Validation in one fixed order (a sampler of world size 1, unshuffled), which every process
    // can rebuild: burn-ddp shares one device's validation batches out across the ranks.
    let test_len = test_items.len();
    let test_loader: Arc<dyn DataLoader<FashionBatch>> = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::<FashionItem>::new(test_items)),
            FashionBatcher,
            DistributedSampler::new(test_len, 1)
                .map_err(|e| e.to_string())?
                .without_shuffle(),
            256,
            device.clone().inner(),
        )
        .map_err(|e| e.to_string())?,
    );

    let learner = Learner::new(model, AdamConfig::new().init(), args.lr);
    // Every rank reads checkpoints from the same directory; only rank 0 renders, logs metrics
    // and writes checkpoints.
    let training = SupervisedTraining::new(&args.artifacts, train_loader, test_loader)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(args.epochs)
        .renderer(Box::new(MainProcessRenderer::new(
            printer::EpochPrinter::new(),
        )))
        .with_metric_logger(MainProcessLogger::new(FileMetricLogger::new(
            &args.artifacts,
        )))
        .with_application_logger(None);
    // Under a launcher a restart resumes, so checkpoints are always written there.
    let checkpointing = args.checkpoint || args.resume || multi_process;
    let Some(strategy) = strategy else {
        let training = if checkpointing {
            // burn-ddp's checkpointers write burn-train's files atomically (burn-train's own
            // write them in place); burn-train resumes its newest complete epoch by number.
            let config = DdpConfig::default().with_checkpoint_dir(&checkpoints);
            let [model, optim, scheduler] = config.checkpointers().map_err(|e| e.to_string())?;
            let training = training.with_custom_checkpointers(model, optim, scheduler);
            match plain_resume {
                Some(epoch) => training.checkpoint(epoch),
                None => training,
            }
        } else {
            training
        };
        let result = training
            .with_training_strategy(ExecutionStrategy::SingleDevice(device).into())
            .launch(learner);
        return match result.error {
            None => Ok(()),
            Some(e) => Err(Failure::Other(format!("training failed: {e}"))),
        };
    };
    // Step checkpoints (SIGTERM/SIGINT, --checkpoint-every) and the resume go to the same place
    // as burn-train's epoch checkpoints; a restart by the launcher resumes by itself.
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
    let training = if checkpointing {
        // burn-ddp's checkpointers of burn-train's records: atomic (a file is the old one or the
        // complete new one, never half written), bound by their SHA-256 to the epoch's state.
        let [model, optim, scheduler] = config.checkpointers().map_err(|e| e.to_string())?;
        training.with_custom_checkpointers(model, optim, scheduler)
    } else {
        training
    };
    // burn-ddp prints its report (samples/s, time per rank) at the end of training.
    match training.launch_ddp(learner, strategy.with_config(config)) {
        // burn-train 0.22 reports what stopped the run (a metric or logger failure) here.
        Ok(result) => match result.error {
            None => Ok(()),
            Some(e) => Err(Failure::Other(format!("training failed: {e}"))),
        },
        Err(e @ DdpError::Preempted { .. }) => Err(Failure::Stopped(e.to_string())),
        Err(e) => Err(Failure::Other(format!("training failed: {e}"))),
    }
}

/// The newest epoch with all three of burn-train's records in `dir` (`model-`, `optim-` and
/// `scheduler-<epoch>.bpk`), for plain Burn's `SupervisedTraining::checkpoint`.
fn newest_epoch_checkpoint(dir: &std::path::Path) -> Option<usize> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            name.strip_prefix("model-")?
                .strip_suffix(".bpk")?
                .parse::<usize>()
                .ok()
        })
        .filter(|epoch| {
            ["optim", "scheduler"]
                .iter()
                .all(|record| dir.join(format!("{record}-{epoch}.bpk")).is_file())
        })
        .max()
}
