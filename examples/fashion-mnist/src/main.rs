//! Fashion-MNIST on N replicas with burn-ddp.
//!
//! `cargo xtask example fashion-mnist -- --workers 2 --epochs 2` trains the CNN of
//! [`model`] on two replicas (two threads on CPU) and prints, per epoch, the train loss, the test
//! accuracy and the training throughput, then each rank's time in communication.
//! `--workers 1` trains with plain Burn on one device, the reference.

mod printer;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use burn::backend::{Autodiff, Flex, NdArray};
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::AdamConfig;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{ExecutionStrategy, Learner, SupervisedTraining};
use burn_ddp::{DdpStrategy, DdpTraining, DistributedDataLoader, DistributedSampler};
use clap::{Parser, ValueEnum};

use fashion_mnist::data::{self, FashionBatcher, FashionItem};
use fashion_mnist::model::Cnn;

/// Train a CNN on Fashion-MNIST with data parallelism (burn-ddp).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Replicas (one thread each on CPU, one per GPU on CUDA); 1 trains with plain Burn.
    #[arg(long, default_value_t = 2)]
    workers: usize,
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
    /// Directory for burn-train's logs and metrics.
    #[arg(long, default_value = "target/fashion-mnist")]
    artifacts: PathBuf,
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
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run_with_backend(args: &Args) -> Result<(), String> {
    if args.workers == 0 {
        return Err("--workers must be at least 1".into());
    }
    if !args.batch_size.is_multiple_of(args.workers) {
        return Err(format!(
            "--batch-size {} does not divide between {} workers: the global batch is split evenly",
            args.batch_size, args.workers
        ));
    }
    match (args.device, args.backend) {
        (DeviceKind::Cpu, CpuBackend::Flex) => {
            train::<Autodiff<Flex>>(args, vec![Default::default(); args.workers])
        }
        (DeviceKind::Cpu, CpuBackend::Ndarray) => {
            train::<Autodiff<NdArray>>(args, vec![Default::default(); args.workers])
        }
        (DeviceKind::Cuda, _) => cuda(args),
    }
}

#[cfg(feature = "cuda")]
fn cuda(args: &Args) -> Result<(), String> {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;
    let devices = (0..args.workers).map(CudaDevice::new).collect();
    train::<Autodiff<Cuda>>(args, devices)
}

#[cfg(not(feature = "cuda"))]
fn cuda(_args: &Args) -> Result<(), String> {
    Err(
        "this binary was built without CUDA: rebuild with `--features cuda` \
         (cargo xtask example fashion-mnist --features cuda -- --device cuda)"
            .into(),
    )
}

fn train<B: AutodiffBackend>(args: &Args, devices: Vec<B::Device>) -> Result<(), String> {
    let dataset = data::load(args.data.as_deref()).map_err(|e| e.to_string())?;
    let mut train_items = dataset.train;
    if let Some(limit) = args.train_limit {
        train_items.truncate(limit);
    }
    println!(
        "Fashion-MNIST from {}: {} training images, {} test images; {} worker(s), global batch {}, {} backend",
        dataset.source.display(),
        train_items.len(),
        dataset.test.len(),
        args.workers,
        args.batch_size,
        match args.device {
            DeviceKind::Cuda => "cuda",
            DeviceKind::Cpu => match args.backend {
                CpuBackend::Flex => "flex",
                CpuBackend::Ndarray => "ndarray",
            },
        }
    );

    let device = devices[0].clone();
    B::seed(&device, args.seed);
    let model = Cnn::<B>::new(&device);
    // Burn creates parameters lazily; create them now, from the seed, on this thread.
    let _ = burn_ddp::value_fingerprint(&model);

    let train_len = train_items.len();
    let sampler = DistributedSampler::new(train_len, args.workers)
        .map_err(|e| e.to_string())?
        .with_seed(args.seed);
    let train_loader: Arc<dyn DataLoader<B, data::FashionBatch<B>>> = Arc::new(
        DistributedDataLoader::new(
            Arc::new(InMemDataset::new(train_items)),
            FashionBatcher,
            sampler,
            args.batch_size / args.workers,
            device.clone(),
        )
        .map_err(|e| e.to_string())?,
    );
    let test_loader = DataLoaderBuilder::new(FashionBatcher)
        .batch_size(256)
        .set_device(device.clone())
        .build(InMemDataset::<FashionItem>::new(dataset.test));

    let learner = Learner::new(model, AdamConfig::new().init(), args.lr);
    let training = SupervisedTraining::new(&args.artifacts, train_loader, test_loader)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(args.epochs)
        .renderer(printer::EpochPrinter::default())
        .with_application_logger(None);

    if args.workers == 1 {
        training
            .with_training_strategy(ExecutionStrategy::SingleDevice(device).into())
            .launch(learner);
        return Ok(());
    }
    let strategy = DdpStrategy::new(devices);
    let handle = strategy.clone();
    training
        .launch_ddp(learner, strategy)
        .map_err(|e| format!("training failed: {e}"))?;
    let report = handle.report();
    println!("time per rank (forward+backward / gradient sync incl. waiting / optimizer):");
    for rank in &report.ranks {
        println!(
            "  rank {}: {} batches, compute {:.1} s, communication {:.2} s ({:.1} MiB all-reduced, \
             {:.2} s in all-reduce, {:.2} s per-step agreement), optimizer {:.2} s",
            rank.rank,
            rank.batches,
            rank.compute.as_secs_f64(),
            (rank.comm.total() + rank.coordination).as_secs_f64(),
            rank.comm.bytes as f64 / (1024.0 * 1024.0),
            rank.comm.all_reduce.as_secs_f64(),
            rank.coordination.as_secs_f64(),
            rank.optimizer.as_secs_f64(),
        );
    }
    Ok(())
}
