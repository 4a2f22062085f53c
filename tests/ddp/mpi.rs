//! The MPI process group (feature `mpi`): jobs started by `mpirun` (Open MPI), whose ranks meet
//! and reduce through MPI, compared with single-device training and with `TcpGroup`. Every job
//! runs as `mpirun --oversubscribe --allow-run-as-root -np N ddp-worker ...` (a 2-core CI
//! machine, as root), bounded in time: a job still running after its bound is killed with its
//! whole process group and the test fails.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use burn_ddp::DdpConfig;
use burn_ddp::group::ReduceOp;
use burn_ddp_tests::{
    Run, clean_env, collective_input, deterministic_mlp, finish_within, max_relative_difference,
    over_tcp, read_tensors, run_training, train_mlp,
};

const WORKER: &str = env!("CARGO_BIN_EXE_ddp-worker");
const T: Duration = Duration::from_secs(30);

/// What `mpirun` left: its exit code (`None`: killed by a signal), stdout and stderr of every
/// rank together, and how long it ran.
struct Job {
    code: Option<i32>,
    output: String,
    took: Duration,
}

/// Runs `mpirun -np n ddp-worker ARGS` with the variables of any surrounding job removed;
/// kills the job's whole process group if it runs past `within`.
fn mpirun(n: usize, args: &[&str], within: Duration) -> Job {
    let mut command = Command::new("mpirun");
    clean_env(&mut command)
        .args([
            "--oversubscribe",
            "--allow-run-as-root",
            "-np",
            &n.to_string(),
            WORKER,
        ])
        .args(args);
    run_bounded(&mut command, within)
}

/// Runs `command` in a process group of its own, its stdout and stderr captured; kills the
/// whole group (mpirun and its ranks) if it runs past `within`.
fn run_bounded(command: &mut Command, within: Duration) -> Job {
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let child = command
        .spawn()
        .unwrap_or_else(|e| panic!("{command:?} (Open MPI: apt-get install openmpi-bin): {e}"));
    let job = finish_within(child, within, &format!("{command:?}"));
    Job {
        code: job.code,
        output: format!("{}{}", job.stdout, job.stderr),
        took: job.took,
    }
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-ddp-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

#[test]
fn mpirun_with_2_and_4_ranks_trains_as_one_device_and_as_tcp_group() {
    for n in [2usize, 4] {
        let dir = scratch_dir(&format!("train-{n}"));
        let out = dir.join("params.bin");
        let steps = 10;
        let job = mpirun(
            n,
            &[
                "--model",
                "mlp",
                "--out",
                out.to_str().unwrap(),
                "--out-every-rank",
                "--steps",
                &steps.to_string(),
                "--per-rank-batch",
                "4",
            ],
            Duration::from_secs(240),
        );
        assert_eq!(job.code, Some(0), "mpirun -np {n}:\n{}", job.output);
        assert!(
            job.output
                .contains(&format!("{n} replica(s) as processes (mpi)")),
            "{}",
            job.output
        );
        let ranks: Vec<Vec<Vec<f32>>> = (0..n)
            .map(|r| read_tensors(&out.with_extension(format!("rank{r}"))).unwrap())
            .collect();
        for (r, params) in ranks.iter().enumerate() {
            assert!(
                same_bits(params, &ranks[0]),
                "{n} ranks: rank {r}'s parameters differ from rank 0's"
            );
        }
        let mpi = &ranks[0];
        // The reference: one device on the global batch (4 n samples a step), and the initial
        // values, to see that training moved them.
        let initial = burn_ddp_tests::float_tensors(&deterministic_mlp());
        let mut single = Run::new(None, 4 * n, steps * 4 * n);
        single.config = DdpConfig::default();
        let (single, _) = run_training(
            deterministic_mlp(),
            burn::optim::SgdConfig::new().init(),
            0.1,
            &single,
        )
        .unwrap();
        assert!(max_relative_difference(&single, &initial) > 1e-3);
        let diff = max_relative_difference(mpi, &single);
        assert!(diff <= 1e-5, "{n} MPI ranks vs one device: {diff}");
        // The same job over TCP (n ranks on threads of this process, each with a TcpGroup).
        let tcp = over_tcp(n, |_, group| {
            train_mlp(Some(group), steps, 4, DdpConfig::default(), T).map(|(p, _)| p)
        });
        let tcp = tcp.into_iter().next().unwrap().unwrap().unwrap();
        if n == 2 {
            // Two ranks: both orders add the same two numbers.
            assert!(same_bits(mpi, &tcp), "2 ranks: MPI and TCP differ");
        } else {
            let diff = max_relative_difference(mpi, &tcp);
            assert!(diff <= 1e-5, "{n} ranks: MPI vs TCP {diff}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn mpi_collectives_give_every_rank_the_tcp_groups_results() {
    for n in [2usize, 3, 4] {
        let dir = scratch_dir(&format!("collectives-{n}"));
        let out = dir.join("c.bin");
        let job = mpirun(
            n,
            &["mpi-case", "collectives", "--out", out.to_str().unwrap()],
            Duration::from_secs(60),
        );
        assert_eq!(job.code, Some(0), "mpirun -np {n}:\n{}", job.output);
        let ranks: Vec<Vec<Vec<f32>>> = (0..n)
            .map(|r| read_tensors(&out.with_extension(format!("rank{r}"))).unwrap())
            .collect();
        let tcp = over_tcp(n, |rank, group| {
            let t = Duration::from_secs(30);
            let mut sum: Vec<f32> = (0..10_007).map(|i| collective_input(rank, i)).collect();
            let mut avg = sum.clone();
            group.all_reduce(&mut sum, ReduceOp::Sum, t).unwrap();
            group.all_reduce(&mut avg, ReduceOp::Avg, t).unwrap();
            (sum, avg)
        });
        let (tcp_sum, tcp_avg) = tcp.into_iter().next().unwrap().unwrap();
        for (r, got) in ranks.iter().enumerate() {
            // Everything but the reduce-scatter (each rank its own block) is the same everywhere.
            assert!(
                same_bits(&got[..8], &ranks[0][..8]),
                "{n} ranks: rank {r} got other bits than rank 0"
            );
            let [
                sum,
                avg,
                broadcast,
                gathered,
                empty,
                tiny,
                half,
                gathered_f32,
                scattered,
            ] = &got[..]
            else {
                panic!("rank {r} wrote {} tensors", got.len());
            };
            let expected: Vec<f32> = (0..n).flat_map(|q| [q as f32 + 0.25; 3]).collect();
            assert_eq!(gathered_f32, &expected, "{n} ranks: all_gather_f32");
            for (j, &got) in scattered.iter().enumerate() {
                let i = r * 5 + j;
                let expected: f32 = (0..n).map(|q| collective_input(q, i)).sum();
                assert!(
                    (got - expected).abs() <= 1e-5 * expected.abs().max(1.0),
                    "{n} ranks: rank {r}'s reduce_scatter value {j}: {got}, expected {expected}"
                );
            }
            let ranks_sum = (1..=n).sum::<usize>() as f32;
            assert_eq!(tiny, &vec![ranks_sum, 2.0 * n as f32]);
            // f16 averages: the f16 inputs summed in f32 (exact here: every input is a multiple
            // of 2^-14 below 25), divided in f32, rounded to f16 at the end.
            let format = burn_ddp::comm::group::HalfFloat::F16;
            for (i, &got) in half.iter().enumerate() {
                let exact: f32 = (0..n)
                    .map(|q| format.to_f32(format.from_f32(collective_input(q, i))))
                    .sum::<f32>()
                    / n as f32;
                assert_eq!(
                    got,
                    format.to_f32(format.from_f32(exact)),
                    "{n} ranks: f16 average {i}"
                );
            }
            if n == 2 {
                assert!(same_bits(
                    &[sum.clone(), avg.clone()],
                    &[tcp_sum.clone(), tcp_avg.clone()]
                ));
            } else {
                let d = max_relative_difference(
                    &[sum.clone(), avg.clone()],
                    &[tcp_sum.clone(), tcp_avg.clone()],
                );
                assert!(d <= 1e-6, "{n} ranks: MPI sums differ from TCP's by {d}");
            }
            // Against a plain sum too.
            for i in (0..10_007).step_by(101) {
                let expected: f32 = (0..n).map(|q| collective_input(q, i)).sum();
                assert!((sum[i] - expected).abs() <= 1e-4 * expected.abs().max(1.0));
                assert!((avg[i] - expected / n as f32).abs() <= 1e-4 * expected.abs().max(1.0));
            }
            assert!(broadcast.iter().all(|&v| v == (n - 1) as f32 + 0.5));
            let expected: Vec<f32> = (0..n).flat_map(|q| [q as f32, 7.0]).collect();
            assert_eq!(gathered, &expected);
            assert_eq!(empty, &vec![0.0]);
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn a_rank_that_never_calls_the_collective_ends_every_rank_within_the_timeout_naming_it() {
    let job = mpirun(2, &["mpi-case", "silent"], Duration::from_secs(60));
    // Rank 1 sleeps 20 s; rank 0's 1 s timeout must end both long before.
    assert!(job.took < Duration::from_secs(15), "took {:?}", job.took);
    assert_ne!(job.code, Some(0), "{}", job.output);
    assert!(
        job.output
            .contains("all_reduce(sum, 16 f32) #0 on rank 0 timed out after 1 s"),
        "{}",
        job.output
    );
    assert!(job.output.contains("MPI_Abort"), "{}", job.output);
    assert_eq!(job.code, Some(1), "MPI_Abort's exit code:\n{}", job.output);
}

#[test]
fn a_rank_that_fails_in_training_ends_the_job_naming_its_failure() {
    // Rank 1 panics in its 2nd batch: the strategy aborts the group, which under MPI prints the
    // failure and ends every rank (rank 0 waits in the step's all-reduce meanwhile).
    let job = mpirun(
        2,
        &[
            "--panic-rank",
            "1",
            "--panic-at-batch",
            "2",
            "--steps",
            "4",
            "--timeout-s",
            "60",
        ],
        Duration::from_secs(90),
    );
    assert!(job.took < Duration::from_secs(45), "took {:?}", job.took);
    assert_eq!(job.code, Some(1), "{}", job.output);
    assert!(
        job.output.contains("rank 1 aborted the group"),
        "{}",
        job.output
    );
    assert!(
        job.output.contains("panicking on purpose at batch 2"),
        "{}",
        job.output
    );
    assert!(
        job.output.contains("ending the MPI job (MPI_Abort"),
        "{}",
        job.output
    );
    assert!(
        !job.output.contains("ddp-worker rank 0: done"),
        "{}",
        job.output
    );
}

#[test]
fn a_process_mpi_starts_alone_while_the_launcher_announced_more_is_an_error() {
    // As under `srun` without `--mpi=pmix`: the launcher's variables say 2 ranks, MPI (not
    // reached) makes this process a world of one. Without the check it would train alone.
    let mut command = Command::new(WORKER);
    clean_env(&mut command)
        .args(["mpi-case", "collectives"])
        .env("PMI_RANK", "1")
        .env("PMI_SIZE", "2");
    let job = run_bounded(&mut command, Duration::from_secs(60));
    assert_eq!(job.code, Some(1), "{}", job.output);
    assert!(
        job.output
            .contains("MPI gives this process a world of 1 but PMI_SIZE=2"),
        "{}",
        job.output
    );
}

#[test]
fn a_rank_that_exits_without_a_collective_ends_the_job() {
    let job = mpirun(2, &["mpi-case", "exit"], Duration::from_secs(60));
    // Rank 0 waits with a 30 s timeout; mpirun ends it as soon as rank 1 is gone.
    assert!(job.took < Duration::from_secs(25), "took {:?}", job.took);
    assert_ne!(job.code, Some(0), "{}", job.output);
    assert!(
        job.output
            .contains("ddp-worker rank 1: exiting without a collective"),
        "{}",
        job.output
    );
    assert!(
        !job.output.contains("ddp-worker rank 0: done"),
        "{}",
        job.output
    );
    // mpirun names the rank that left.
    assert!(job.output.contains("process rank 1"), "{}", job.output);

    // The same in training: rank 1 dies at its 2nd batch, rank 0 is in the step's collectives.
    let job = mpirun(
        2,
        &["--fail-rank", "1", "--fail-at-batch", "2", "--steps", "4"],
        Duration::from_secs(60),
    );
    assert!(job.took < Duration::from_secs(40), "took {:?}", job.took);
    assert_ne!(job.code, Some(0), "{}", job.output);
    assert!(
        job.output
            .contains("ddp-worker rank 1: failing on purpose at batch 2"),
        "{}",
        job.output
    );
    // mpirun names the process that failed: "Process name: [[<job>,1],1]", exit code 3.
    assert!(
        job.output.contains("],1]") && job.output.contains("Exit code:    3"),
        "{}",
        job.output
    );
    assert!(
        !job.output.contains("ddp-worker rank 0: done"),
        "{}",
        job.output
    );
}

#[test]
fn different_lengths_or_operations_are_a_mismatch_on_every_rank() {
    for (case, theirs) in [
        ("mismatch-len", "all_reduce(sum, 11 f32) #0"),
        ("mismatch-op", "broadcast(root 0, 10 f32) #0"),
        ("mismatch-half", "all_reduce_half(sum, 10 bf16) #0"),
    ] {
        let job = mpirun(2, &["mpi-case", case], Duration::from_secs(60));
        assert_eq!(job.code, Some(1), "{case}:\n{}", job.output);
        let ours = if case == "mismatch-half" {
            "all_reduce_half(sum, 10 f16) #0"
        } else {
            "all_reduce(sum, 10 f32) #0"
        };
        // Rank 0 names rank 1's call; rank 1 names rank 0's.
        assert!(
            job.output.contains(&format!(
                "collective mismatch seen by rank 0: it called {ours}, but rank 1 called {theirs}"
            )),
            "{case}:\n{}",
            job.output
        );
        assert!(
            job.output
                .contains("collective mismatch seen by rank 1: it called"),
            "{case}:\n{}",
            job.output
        );
        if case == "mismatch-len" {
            assert!(
                job.output.contains("then Err(Aborted"),
                "later calls must be refused:\n{}",
                job.output
            );
        }
    }
}
