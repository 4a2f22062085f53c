//! Fashion-MNIST with a training loop of your own: burn-ddp without burn-train's `Learner`.
//!
//! `cargo xtask example fashion-mnist --bin custom-loop -- --workers 2 --epochs 2` trains the
//! example's CNN on two replicas (threads); under `burn-ddp run --nproc-per-node 2` (or
//! `cargo xtask launch --nproc-per-node 2 -- custom-loop`) each process is one replica, its
//! `TcpGroup` built from the launcher's variables. What it shows, in the order a loop needs it:
//!
//! 1. a process group: threads (`ThreadGroup`) when no launcher started us, else this process's
//!    rank (`TcpGroup::from_env`; `MpiGroup::world` under `mpirun` with the `mpi` feature);
//! 2. `DistributedDataParallel::new`: the replicas checked, rank 0's parameters everywhere;
//! 3. each rank's shard of the real dataset (`DistributedSampler::with_rank`), a new shuffle
//!    every epoch, the global batch split between the ranks;
//! 4. `sync_gradients` before every optimizer step;
//! 5. validation sharded (each test image once, on one rank) and its metrics reduced with one
//!    all-reduce, after averaging BatchNorm's statistics across the replicas;
//! 6. only rank 0 printing and saving the model.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::data::dataloader::DataLoader;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::Device;
use burn_ddp::comm::topology::Topology;
use burn_ddp::group::{ReduceOp, TcpGroupOptions};
use burn_ddp::{
    DdpConfig, DdpError, DistributedDataLoader, DistributedDataParallel, DistributedSampler,
    ProcessGroup,
    group::{TcpGroup, ThreadGroup},
};
use clap::Parser;

use fashion_mnist::data::{self, FashionBatcher, FashionItem};
use fashion_mnist::model::Cnn;

/// Train the Fashion-MNIST CNN with a hand-written loop on burn-ddp.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Replicas as threads when no launcher started this process (ignored under one: each
    /// process is one replica).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Epochs over the training set.
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Global batch size (samples per optimizer step over all replicas); must divide by the
    /// number of replicas.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Learning rate of Adam.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Seed of the initial weights and of the data order.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Train on the first N images only (quick runs).
    #[arg(long)]
    train_limit: Option<usize>,
    /// Validate on the first N test images only (quick runs; default: all 10,000).
    #[arg(long)]
    test_limit: Option<usize>,
    /// Directory with the four IDX files (default: $FASHION_MNIST_DIR, the Debian package, the
    /// cache, a download).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Where rank 0 saves the trained model (`model.bpk`, Burn's burnpack).
    #[arg(long, default_value = "target/custom-loop")]
    out: PathBuf,
}

/// How long a collective of this loop may wait for the other ranks.
const TIMEOUT: Duration = Duration::from_secs(300);

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// This process's rank, when a launcher started it: `None` for a process on its own.
fn process_group() -> Result<Option<Arc<dyn ProcessGroup>>, DdpError> {
    #[cfg(feature = "mpi")]
    if burn_ddp::comm::group::launched_by_mpi() {
        return Ok(Some(Arc::new(burn_ddp::group::MpiGroup::world()?)));
    }
    if Topology::from_env()?.is_none() {
        return Ok(None);
    }
    Ok(Some(Arc::new(TcpGroup::from_env(
        &TcpGroupOptions::default(),
    )?)))
}

fn run(args: &Args) -> Result<(), String> {
    let dataset = data::load(args.data.as_deref()).map_err(|e| e.to_string())?;
    let mut train = dataset.train;
    if let Some(limit) = args.train_limit {
        train.truncate(limit);
    }
    let mut test = dataset.test;
    if let Some(limit) = args.test_limit {
        test.truncate(limit);
    }
    let (train, test) = (Arc::new(train), Arc::new(test));
    let model = initial_model(args.seed);
    let Some(group) = process_group().map_err(|e| e.to_string())? else {
        // Threads: one rank each, sharing the dataset, each starting from a copy of the model
        // made from its record (a clone would share BatchNorm's running statistics).
        let groups = ThreadGroup::new_group(args.workers).map_err(|e| e.to_string())?;
        return std::thread::scope(|s| {
            let ranks: Vec<_> = groups
                .into_iter()
                .map(|group| {
                    let (train, test) = (train.clone(), test.clone());
                    let model = Cnn::new(&device()).load_record(model.clone().into_record());
                    s.spawn(move || train_rank(Arc::new(group), model, args, &train, &test))
                })
                .collect();
            // Every rank joined; then the first failure (the others ended with it: the failing
            // rank aborted the group).
            let results: Vec<Result<(), String>> = ranks
                .into_iter()
                .map(|rank| {
                    rank.join()
                        .unwrap_or_else(|_| Err("a rank panicked".into()))
                })
                .collect();
            results.into_iter().collect()
        });
    };
    train_rank(group, model, args, &train, &test)
}

/// The model every rank starts from, drawn from `seed` on this thread. Burn's random generator
/// is one per process and parameters are created when first used: replicas that are threads
/// drawing their own would interleave their draws, and rank 0's starting point (which every
/// replica copies) would change from run to run.
fn initial_model(seed: u64) -> Cnn {
    let device = device();
    device.seed(seed);
    let model = Cnn::new(&device);
    // Create the parameters now, from the seed, on this thread.
    let _ = burn_ddp::mechanism::value_fingerprint(&model);
    model
}

/// One rank's training: on failure, aborts the group so the other ranks stop at once.
fn train_rank(
    group: Arc<dyn ProcessGroup>,
    model: Cnn,
    args: &Args,
    train: &[FashionItem],
    test: &[FashionItem],
) -> Result<(), String> {
    let result = train_epochs(group.clone(), model, args, train, test);
    if let Err(message) = &result {
        group.abort(message);
    }
    result
}

fn train_epochs(
    group: Arc<dyn ProcessGroup>,
    model: Cnn,
    args: &Args,
    train: &[FashionItem],
    test: &[FashionItem],
) -> Result<(), String> {
    let (rank, world_size) = (group.rank(), group.world_size());
    if !args.batch_size.is_multiple_of(world_size) {
        return Err(format!(
            "--batch-size {} does not divide between {world_size} replicas",
            args.batch_size
        ));
    }
    let device = device();
    // Checks that every replica has the same layers, then copies rank 0's parameters to all.
    let (mut ddp, mut model) =
        DistributedDataParallel::new(group.clone(), model, &device, DdpConfig::default())
            .map_err(|e| e.to_string())?;
    let mut optimizer: ModuleOptimizer = AdamConfig::new().init();

    // This rank's shard: a new global shuffle every epoch (the loader counts its epochs), every
    // image once; each step holds one device's batch, the last one possibly short.
    let sampler = DistributedSampler::new(train.len(), world_size)
        .and_then(|s| s.with_seed(args.seed).with_rank(rank))
        .map_err(|e| e.to_string())?;
    let train_loader = DistributedDataLoader::new(
        Arc::new(InMemDataset::new(train.to_vec())),
        FashionBatcher,
        sampler,
        args.batch_size / world_size,
        device.clone(),
    )
    .map_err(|e| e.to_string())?;
    // Validation: contiguous shards covering the test set exactly once (no padding, no
    // shuffle), so the reduced metrics are those of the whole set.
    let sampler = DistributedSampler::new(test.len(), world_size)
        .and_then(|s| s.without_shuffle().with_uneven_shards().with_rank(rank))
        .map_err(|e| e.to_string())?;
    let test_loader = DistributedDataLoader::new(
        Arc::new(InMemDataset::new(test.to_vec())),
        FashionBatcher,
        sampler,
        256,
        device.clone().inner(),
    )
    .map_err(|e| e.to_string())?;

    if rank == 0 {
        println!(
            "Fashion-MNIST: {} training images, {} test images; {world_size} replica(s) as {}, \
             global batch {}",
            train.len(),
            test.len(),
            if group.backend() == "threads" {
                "threads"
            } else {
                "processes"
            },
            args.batch_size
        );
    }
    let loss = CrossEntropyLossConfig::new().init(&device);
    for epoch in 1..=args.epochs {
        let started = Instant::now();
        let (mut loss_sum, mut steps) = (0.0f32, 0.0f32);
        // Every rank takes part in every step: `None` when the epoch's short last step leaves
        // this rank without an image.
        for batch in train_loader.iter_steps() {
            let grads = match batch.map_err(|e| e.to_string())? {
                Some(batch) => {
                    let logits = model.forward(batch.images);
                    let batch_loss = loss.forward(logits, batch.targets);
                    loss_sum += batch_loss.clone().into_scalar::<f32>();
                    steps += 1.0;
                    GradientsParams::from_grads(batch_loss.backward(), &model)
                }
                None => GradientsParams::new(),
            };
            // Averaged across the replicas, each weighed by its images in the step: every rank
            // applies the same update.
            let grads = ddp
                .sync_gradients(&model, grads)
                .map_err(|e| e.to_string())?;
            model = ddp
                .optimizer_step(&mut optimizer, args.lr, model, grads)
                .map_err(|e| e.to_string())?;
        }
        // BatchNorm's running statistics saw each rank's samples only: average them first.
        model = ddp.average_buffers(model).map_err(|e| e.to_string())?;
        let (correct, count) = validate(&model.valid(), &test_loader)?;
        // One all-reduce: the sums of every rank's training loss and validation counts.
        let mut sums = [loss_sum, steps, correct, count];
        group
            .all_reduce(&mut sums, ReduceOp::Sum, TIMEOUT)
            .map_err(|e| e.to_string())?;
        if rank == 0 {
            println!(
                "epoch {epoch}: train loss {:.4}, test accuracy {:.2}% ({} images), {:.1} s",
                sums[0] / sums[1],
                100.0 * sums[2] / sums[3],
                sums[3],
                started.elapsed().as_secs_f64()
            );
        }
    }
    if rank == 0 {
        std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
        let path = args.out.join("model");
        let path = path.with_extension("bpk");
        model
            .save_file(&path)
            .map_err(|e| format!("cannot save the model to {}: {e}", path.display()))?;
        println!("saved the model to {}", path.display());
    }
    Ok(())
}

/// Burn's CPU device, Flex, with autodiff (what training needs; validation takes its inner
/// device).
fn device() -> Device {
    Device::flex().autodiff()
}

/// Correct predictions and images on this rank's shard of the test set.
///
/// # Errors
/// A batch that could not be built (the loader's error, as text).
fn validate(
    model: &Cnn,
    loader: &DistributedDataLoader<FashionItem, data::FashionBatch>,
) -> Result<(f32, f32), String> {
    let (mut correct, mut count) = (0.0, 0.0);
    for batch in loader.iter() {
        let batch = batch.map_err(|e| e.to_string())?;
        let predicted = model.forward(batch.images).argmax(1).flatten::<1>(0, 1);
        count += batch.targets.dims()[0] as f32;
        correct += predicted
            .equal(batch.targets)
            .int()
            .sum()
            .into_scalar::<f32>();
    }
    Ok((correct, count))
}
