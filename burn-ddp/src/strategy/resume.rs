//! Where a run starts, and the checkpoints it can start from.
//!
//! Two kinds of checkpoints live in [`DdpConfig::with_checkpoint_dir`]:
//! - burn-train's epoch checkpoints (`model-<epoch>`, `optim-<epoch>`, `scheduler-<epoch>`, with
//!   the user's recorder), written by rank 0 at the end of every epoch; the end-of-epoch barrier
//!   waits until they are on disk and readable ([`wait_for_epoch_checkpoint`]);
//! - burn-ddp's step checkpoints ([`StepCheckpoints`]), written by rank 0 in the middle of an
//!   epoch when the job is asked to stop by a signal, or every
//!   [`DdpConfig::with_checkpoint_every`] optimizer steps: the same three records in full
//!   precision plus a [`StepState`] saying how far the epoch got.
//!
//! With [`DdpConfig::with_resume`] a run starts from the newest of them that loads (a truncated or
//! unreadable one is passed over, with a warning that names it and why), mid-epoch for a step
//! checkpoint: the batches already trained are skipped, so the run continues exactly as the
//! uninterrupted one would have.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use burn::train::{Learner, LearningCheckpointer, LearningComponentsTypes, TrainingBackend};

use super::step_checkpoints::{StepCheckpoints, quietly};
use crate::checkpoint::{DdpState, StepState, epoch_checkpoints};
use crate::config::DdpConfig;
use crate::error::{DdpError, Result};

/// Where a run starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Resume {
    /// The first epoch to train (burn-train counts from 1).
    pub starting_epoch: usize,
    /// Batches of `starting_epoch` already trained (from a step checkpoint), skipped.
    pub batches: usize,
    /// Optimizer steps of the run so far.
    pub optimizer_steps: u64,
    /// Gradient synchronisations of the run so far (they number the step checkpoints).
    pub synchronisations: u64,
}

impl Resume {
    /// The run continues from a checkpoint (its model and optimizer state were loaded).
    pub fn resumed(&self) -> bool {
        self.starting_epoch > 1 || self.batches > 0 || self.optimizer_steps > 0
    }
}

/// A checkpoint a run could start from.
enum Candidate {
    Epoch(usize),
    Step(StepState),
}

impl Candidate {
    /// Completed epochs and batches of the next one.
    fn progress(&self) -> (usize, usize) {
        match self {
            Candidate::Epoch(epoch) => (*epoch, 0),
            Candidate::Step(state) => (state.epoch.saturating_sub(1), state.batches),
        }
    }

    fn describe(&self, dir: &Path) -> String {
        match self {
            Candidate::Epoch(epoch) => format!(
                "the checkpoint of epoch {epoch} ({}/model-{epoch})",
                dir.display()
            ),
            Candidate::Step(state) => format!(
                "step checkpoint {} (batch {} of epoch {}, {})",
                state.number,
                state.batches,
                state.epoch,
                state.file_in(dir).display()
            ),
        }
    }

    /// The file that says which run wrote it.
    fn state_path(&self, dir: &Path) -> PathBuf {
        match self {
            Candidate::Epoch(epoch) => DdpState::path(dir, *epoch),
            Candidate::Step(state) => state.file_in(dir),
        }
    }
}

/// Where a run looks for a checkpoint to start from.
pub(super) struct Resuming<'a> {
    /// This run's id: with [`DdpConfig::with_resume`] only its own checkpoints are taken.
    pub run_id: &'a str,
    /// The launcher restarted the job (it resumes by itself, and starts afresh with a warning
    /// when there is nothing of the run's to resume).
    pub restarted: bool,
    /// The first rank of this process (rank 0 tells the console).
    pub rank: usize,
    /// The job's ranks.
    pub world_size: usize,
    /// The key this job signs its checkpoints with (a token's), if any.
    pub key: Option<burn_ddp_comm::auth::CheckpointKey>,
}

/// A checkpoint found, with the run that wrote it (`None`: no burn-ddp state says).
struct Found {
    candidate: Candidate,
    owner: Option<String>,
}

/// The checkpoints of `dir` (epoch ones only when `epochs` is the checkpointer of `dir`),
/// newest first, with their owners; state files that cannot be read, as `(path, why)`.
fn candidates_in(dir: &Path, epochs: bool) -> (Vec<Found>, Vec<String>) {
    let mut found = Vec::new();
    let mut unreadable = Vec::new();
    for state in StepState::list(dir) {
        match state {
            Ok(state) => found.push(Found {
                owner: state.run_id.clone(),
                candidate: Candidate::Step(state),
            }),
            Err((path, why)) => unreadable.push(format!("{}: {why}", path.display())),
        }
    }
    if epochs {
        for epoch in epoch_checkpoints(dir) {
            let owner = DdpState::read(dir, epoch)
                .ok()
                .flatten()
                .and_then(|s| s.run_id);
            found.push(Found {
                candidate: Candidate::Epoch(epoch),
                owner,
            });
        }
    }
    found.sort_by_key(|f| std::cmp::Reverse(f.candidate.progress()));
    (found, unreadable)
}

/// The checkpoints `config.resume_from()` points at: a step state file, an epoch's state file, or
/// a directory (every checkpoint in it).
fn pointed_at(path: &Path, checkpoint_dir: Option<&Path>) -> Result<(PathBuf, Vec<Found>)> {
    let not_one = |detail: String| DdpError::Checkpoint {
        path: path.display().to_string(),
        detail,
    };
    if path.is_dir() {
        let epochs = checkpoint_dir == Some(path);
        let (found, _) = candidates_in(path, epochs);
        return Ok((path.to_path_buf(), found));
    }
    let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let number = |prefix: &str| -> Option<u64> {
        name.strip_prefix(prefix)?
            .strip_suffix(".json")?
            .parse()
            .ok()
    };
    if name.starts_with("ddp-step-") && name.ends_with(".json") {
        let state = StepState::read(path)
            .map_err(|why| not_one(format!("no readable step checkpoint state there: {why}")))?;
        return Ok((
            dir,
            vec![Found {
                owner: state.run_id.clone(),
                candidate: Candidate::Step(state),
            }],
        ));
    }
    if let Some(epoch) = number("ddp-state-") {
        if checkpoint_dir != Some(dir.as_path()) {
            return Err(not_one(format!(
                "an epoch's checkpoint is burn-train's, in the checkpoint directory ({}): point \
                 at a state file there, or at a step checkpoint",
                checkpoint_dir.map_or("not set".into(), |d| d.display().to_string())
            )));
        }
        let owner = DdpState::read(&dir, epoch as usize)?.and_then(|s| s.run_id);
        return Ok((
            dir,
            vec![Found {
                candidate: Candidate::Epoch(epoch as usize),
                owner,
            }],
        ));
    }
    Err(not_one(
        "not a checkpoint: give a directory, a ddp-step-<run tag>-<n>.json or a ddp-state-<epoch>.json"
            .into(),
    ))
}

/// Loads the checkpoint `config` asks to resume from into `learner`: this run's newest complete
/// one ([`DdpConfig::with_resume`], or a launcher's restart), or the one
/// [`DdpConfig::with_resume_from`] points at; otherwise the run starts where burn-train says
/// (`starting_epoch`, after its own `SupervisedTraining::checkpoint`).
///
/// # Errors
/// [`DdpError::Checkpoint`] when resuming was asked for and there is nothing of this run's to
/// resume from (naming another run's newest checkpoint and both run ids, or the empty
/// directory), when a pointed-at checkpoint cannot be found or loaded, and when the newest usable
/// checkpoint is a step checkpoint of a job with another world size (the batches of a partly
/// trained epoch do not carry over).
pub(super) fn prepare<LC: LearningComponentsTypes>(
    config: &DdpConfig,
    learner: &Learner<LC>,
    epochs: Option<&LearningCheckpointer<LC>>,
    starting_epoch: usize,
    device: &Device<TrainingBackend<LC>>,
    resuming: &Resuming<'_>,
) -> Result<(Option<Learner<LC>>, Resume)> {
    let from_start = Resume {
        starting_epoch,
        batches: 0,
        optimizer_steps: 0,
        synchronisations: 0,
    };
    // burn-train's own `SupervisedTraining::checkpoint(epoch)` continues whichever run wrote
    // that checkpoint, as the user asked.
    let refuse_foreign = || match (epochs, starting_epoch) {
        (Some(_), 0 | 1) => refuse_foreign_epoch_checkpoints(config, resuming),
        _ => Ok(()),
    };
    let asked = config.resume() || config.resume_from().is_some();
    if !asked && !resuming.restarted {
        refuse_foreign()?;
        return Ok((None, from_start));
    }
    let Some((dir, found, own_only)) = candidates(config, epochs.is_some(), asked, resuming)?
    else {
        return Ok((None, from_start));
    };
    let (mine, theirs): (Vec<Found>, Vec<Found>) = found
        .into_iter()
        .partition(|f| !own_only || f.owner.as_deref() == Some(resuming.run_id));
    let key = own_only.then_some(resuming.key.as_ref()).flatten();
    let loading = Loading {
        key,
        learner,
        epochs,
        device,
        dir: &dir,
        resuming,
    };
    let (loaded, skipped) = loading.newest(mine, starting_epoch)?;
    for skip in &skipped {
        burn_ddp_comm::log::warn_console(&format!(
            "rank {}: not resuming from {skip}",
            resuming.rank
        ));
    }
    let (learner, mut resume) = match loaded {
        Some((learner, resume)) => (Some(learner), resume),
        None => {
            nothing_to_resume(&dir, &theirs, &skipped, resuming, asked)?;
            (None, from_start)
        }
    };
    if resume.batches == 0 && resume.starting_epoch > 1 {
        counters_after_epoch(&dir, &mut resume, resuming);
    }
    refuse_foreign()?;
    Ok((learner, resume))
}

/// burn-train writes its epoch checkpoints (`model-<epoch>`, ...) under names that carry no run:
/// a run that would write them into a checkpoint directory holding another run's (or ones no
/// burn-ddp state file claims) would overwrite them, and its checkpointing strategy delete older
/// ones. Such a run is refused, unless it continues that run
/// ([`DdpConfig::with_resume_from`]) or is told it may
/// ([`DdpConfig::with_overwrite_checkpoints`]: rank 0 then says on the console whose
/// checkpoints this run replaces).
///
/// # Errors
/// [`DdpError::Checkpoint`] naming the directory, the other run and its epochs, and the ways out.
fn refuse_foreign_epoch_checkpoints(config: &DdpConfig, resuming: &Resuming<'_>) -> Result<()> {
    let run_id = resuming.run_id;
    let Some(dir) = config.checkpoint_dir() else {
        return Ok(());
    };
    if config.resume_from().is_some() {
        return Ok(());
    }
    let foreign: Vec<(usize, Option<String>)> = epoch_checkpoints(dir)
        .into_iter()
        .map(|epoch| {
            let owner = DdpState::read(dir, epoch)
                .ok()
                .flatten()
                .and_then(|s| s.run_id);
            (epoch, owner)
        })
        .filter(|(_, owner)| owner.as_deref() != Some(run_id))
        .collect();
    let Some((_, owner)) = foreign.first() else {
        return Ok(());
    };
    let epochs: Vec<String> = foreign.iter().map(|(e, _)| e.to_string()).collect();
    let whose = owner.as_deref().map_or(
        "a run no burn-ddp state file names (plain Burn's?)".to_string(),
        |o| format!("run {o}"),
    );
    if config.overwrite_checkpoints() {
        if resuming.rank == 0 {
            burn_ddp_comm::log::warn_console(&format!(
                "checkpoint {}: this run ({run_id}) replaces burn-train's checkpoints of \
                 epoch(s) {} of {whose} as it writes its own (with_overwrite_checkpoints)",
                dir.display(),
                epochs.join(", ")
            ));
        }
        return Ok(());
    }
    Err(DdpError::Checkpoint {
        path: dir.display().to_string(),
        detail: format!(
            "this is run {run_id}, and the directory holds burn-train's checkpoints of epoch(s) \
             {} of {whose}, which this run would overwrite (burn-train's files carry no run): \
             train in another artifact directory, continue that run \
             (DdpConfig::with_resume_from(<the directory>), or BURN_DDP_RUN_ID=<its run id> with \
             with_resume(true)), or let this run overwrite them \
             (DdpConfig::with_overwrite_checkpoints(true))",
            epochs.join(", ")
        ),
    })
}

/// Where to look and what may be taken: the checkpoint directory's candidates (this run's only),
/// or the one [`DdpConfig::with_resume_from`] points at (whoever wrote it). `None`: nowhere to
/// look after a launcher's restart without a checkpoint directory.
///
/// # Errors
/// [`DdpError::InvalidConfig`] for a resume asked for without a checkpoint directory; a
/// pointed-at path that is not a checkpoint.
fn candidates(
    config: &DdpConfig,
    with_epochs: bool,
    asked: bool,
    resuming: &Resuming<'_>,
) -> Result<Option<(PathBuf, Vec<Found>, bool)>> {
    let checkpoint_dir = config.checkpoint_dir();
    if let Some(path) = config.resume_from() {
        let (dir, found) = pointed_at(path, checkpoint_dir)?;
        return Ok(Some((dir, found, false)));
    }
    let Some(dir) = checkpoint_dir else {
        if asked {
            return Err(DdpError::InvalidConfig(
                "DdpConfig::with_resume needs DdpConfig::with_checkpoint_dir (burn-train's \
                 checkpoint directory) or with_resume_from"
                    .into(),
            ));
        }
        return Ok(None);
    };
    let (found, unreadable) = candidates_in(dir, with_epochs);
    for why in unreadable {
        burn_ddp_comm::log::warn_console(&format!(
            "rank {}: not resuming from {why}",
            resuming.rank
        ));
    }
    Ok(Some((dir.to_path_buf(), found, true)))
}

/// Loading a candidate checkpoint into a copy of the learner.
struct Loading<'a, LC: LearningComponentsTypes> {
    /// The job's key when only this run's own checkpoints are taken: they must be signed with
    /// it.
    key: Option<&'a burn_ddp_comm::auth::CheckpointKey>,
    learner: &'a Learner<LC>,
    epochs: Option<&'a LearningCheckpointer<LC>>,
    device: &'a Device<TrainingBackend<LC>>,
    dir: &'a Path,
    resuming: &'a Resuming<'a>,
}

/// A learner loaded from a checkpoint, and where its run continues.
type Loaded<LC> = (Learner<LC>, Resume);

impl<LC: LearningComponentsTypes> Loading<'_, LC> {
    /// The newest of `candidates` past `starting_epoch` that loads, and where the run then
    /// starts; with the reasons the newer ones were passed over.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when the newest usable checkpoint is a step checkpoint of a job
    /// with another world size.
    fn newest(
        &self,
        candidates: Vec<Found>,
        starting_epoch: usize,
    ) -> Result<(Option<Loaded<LC>>, Vec<String>)> {
        let mut skipped = Vec::new();
        for Found { candidate, owner } in candidates
            .into_iter()
            .filter(|f| f.candidate.progress() > (starting_epoch.saturating_sub(1), 0))
        {
            match self.load(&candidate)? {
                Ok(loaded) => {
                    if self.resuming.rank == 0 {
                        burn_ddp_comm::log::info_console(&format!(
                            "resuming from {} of run {}",
                            candidate.describe(self.dir),
                            owner.as_deref().unwrap_or("unknown")
                        ));
                    }
                    let resume = match &candidate {
                        Candidate::Epoch(epoch) => Resume {
                            starting_epoch: epoch + 1,
                            batches: 0,
                            optimizer_steps: 0,
                            synchronisations: 0,
                        },
                        Candidate::Step(state) => Resume {
                            starting_epoch: state.epoch,
                            batches: state.batches,
                            optimizer_steps: state.optimizer_steps,
                            synchronisations: state.number,
                        },
                    };
                    return Ok((Some((loaded, resume)), skipped));
                }
                Err(why) => skipped.push(format!(
                    "{}: it cannot be loaded ({})",
                    candidate.describe(self.dir),
                    // Burn's messages run on with advice about old formats.
                    why.lines()
                        .next()
                        .unwrap_or_default()
                        .split("\\n")
                        .next()
                        .unwrap_or_default()
                )),
            }
        }
        Ok((None, skipped))
    }

    /// `candidate` loaded into a copy of the learner (`Err(why)`: it does not load).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] for a step checkpoint that loads but was taken mid-epoch by a job
    /// of another world size (only a checkpoint that would be used is refused: a truncated one is
    /// passed over like any other, and one at an epoch's first batch re-shards).
    fn load(&self, candidate: &Candidate) -> Result<std::result::Result<Learner<LC>, String>> {
        let world_size = self.resuming.world_size;
        if let Err(why) = self.verify(candidate) {
            return Ok(Err(why));
        }
        let loaded = match candidate {
            Candidate::Epoch(epoch) => self
                .epochs
                .ok_or_else(|| "no file checkpointer".to_string())
                .and_then(|c| {
                    quietly(|| c.load_checkpoint(self.learner.clone(), self.device, *epoch))
                }),
            Candidate::Step(state) => StepCheckpoints::<LC>::loading(self.dir, state).load(
                self.learner.clone(),
                self.device,
                state.number,
            ),
        };
        if let (Ok(_), Candidate::Step(state)) = (&loaded, candidate)
            && state.world_size != world_size
            && state.batches > 0
        {
            return Err(DdpError::Checkpoint {
                path: state.file_in(self.dir).display().to_string(),
                detail: format!(
                    "the newest checkpoint was taken at batch {} of epoch {} by a job of world \
                     size {}, this job has {world_size}: the batches of a partly trained epoch \
                     do not carry over to another world size; resume with {} ranks, or remove \
                     ddp-step-*.json to resume from the last epoch checkpoint",
                    state.batches, state.epoch, state.world_size, state.world_size
                ),
            });
        }
        Ok(loaded)
    }

    /// Why `candidate` is not the checkpoint it claims to be, if it is not: a step checkpoint's
    /// record file that changed since it was written (another run's swapped in, a partial copy);
    /// with the job's key (when resuming this run's own), a state file that is not signed with
    /// it.
    fn verify(&self, candidate: &Candidate) -> std::result::Result<(), String> {
        match candidate {
            Candidate::Step(state) => state.verify(self.dir, self.key),
            Candidate::Epoch(epoch) => match self.key {
                Some(key) => match DdpState::read(self.dir, *epoch) {
                    Ok(Some(state)) if state.signed_by(key) => Ok(()),
                    Ok(_) => Err(format!(
                        "{} is not signed with this job's key",
                        DdpState::path(self.dir, *epoch).display()
                    )),
                    Err(e) => Err(e.to_string()),
                },
                None => Ok(()),
            },
        }
    }
}

/// After an epoch's checkpoint, the run's counters from burn-ddp's state file of that epoch. An
/// epoch boundary: the model and optimizer carry over to any world size, and
/// `DistributedSampler` gives the same global order of samples (re-sharding, which rank 0 tells
/// the console).
fn counters_after_epoch(dir: &Path, resume: &mut Resume, resuming: &Resuming<'_>) {
    let (rank, world_size) = (resuming.rank, resuming.world_size);
    let finished = resume.starting_epoch - 1;
    match DdpState::read(dir, finished) {
        Ok(Some(state)) => {
            resume.optimizer_steps = state.optimizer_steps;
            resume.synchronisations = resume.synchronisations.max(state.synchronisations);
            if state.world_size != world_size && rank == 0 {
                burn_ddp_comm::log::warn_console(&format!(
                    "resuming after epoch {finished}, written by a job of world size {}, with \
                     world size {world_size}: the data is re-sharded (with DistributedSampler \
                     every step still sees the same samples if the global batch is the same, \
                     i.e. the per-rank batch times the world size)",
                    state.world_size
                ));
            }
        }
        Ok(None) => {}
        Err(e) => tracing::warn!("burn-ddp: rank {rank}: {e}"),
    }
}

/// Nothing of this run's could be resumed: an error when resuming was asked for, naming
/// another run's newest checkpoint and both run ids (or the empty directory); a warning after a
/// launcher's restart, whose run then starts afresh.
fn nothing_to_resume(
    dir: &Path,
    theirs: &[Found],
    skipped: &[String],
    resuming: &Resuming<'_>,
    asked: bool,
) -> Result<()> {
    let rank = resuming.rank;
    let newest_other = theirs.first();
    let detail = match newest_other {
        Some(other) => format!(
            "this is run {}, and the newest checkpoint there, {}, belongs to {}: another run's \
             checkpoints are never taken by themselves; resume it with \
             DdpConfig::with_resume_from(<that file or its directory>) (the example: --resume), or \
             continue that run with BURN_DDP_RUN_ID={}",
            resuming.run_id,
            other.candidate.describe(dir),
            other.owner.as_deref().map_or(
                "no run burn-ddp knows of (no burn-ddp state file says)".into(),
                |o| { format!("run {o}") }
            ),
            other.owner.as_deref().unwrap_or("<its run id>")
        ),
        None if skipped.is_empty() => format!(
            "there is no complete checkpoint there for run {} (is it burn-train's checkpoint \
             directory, <artifact dir>/checkpoint?)",
            resuming.run_id
        ),
        None => format!(
            "none of run {}'s checkpoints there loads (see the warnings)",
            resuming.run_id
        ),
    };
    let path = newest_other
        .map(|o| o.candidate.state_path(dir))
        .unwrap_or_else(|| dir.to_path_buf());
    if asked {
        return Err(DdpError::Checkpoint {
            path: path.display().to_string(),
            detail: format!("nothing to resume from: {detail}"),
        });
    }
    if rank == 0 {
        burn_ddp_comm::log::warn_console(&format!(
            "restarted by the launcher, but nothing to resume from in {}: {detail}; training \
             starts from the beginning",
            dir.display()
        ));
    }
    Ok(())
}
