//! Where a run starts, and the checkpoints it can start from.
//!
//! With [`DdpConfig::with_resume`] (or after a launcher's restart) a run starts from the newest
//! checkpoint **of this run** in the checkpoint directory that loads, epoch or step; with
//! [`DdpConfig::with_resume_from`] from the one pointed at, whoever wrote it. A checkpoint that
//! does not load (a record missing, truncated, or not the file its state names; a state not
//! signed with the job's key) is passed over with a warning naming it and why. A step checkpoint
//! resumes mid-epoch: the batches already trained are skipped, so the run continues exactly as the
//! uninterrupted one would have.
//!
//! An epoch checkpoint whose state names its records (written through burn-ddp's
//! checkpointers) is read by burn-ddp, each file checked against its SHA-256; one whose state
//! names none (burn-train's own checkpointers) is read through burn-train's checkpointer, as
//! written.

use std::path::{Path, PathBuf};

use burn::train::{Learner, LearnerModel, LearningCheckpointer};
use burn_ddp_comm::auth::CheckpointKey;
use burn_ddp_comm::log::{info_console, warn_console};

use super::epoch::quietly;
use super::state::{EpochState, SignedState, StepState};
use super::step::Records;
use crate::config::DdpConfig;
use crate::error::{DdpError, Result};

/// Where a run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resume {
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
    /// A run from `starting_epoch` with nothing trained before it by burn-ddp.
    fn from_start(starting_epoch: usize) -> Self {
        Self {
            starting_epoch,
            batches: 0,
            optimizer_steps: 0,
            synchronisations: 0,
        }
    }

    /// The run continues from a checkpoint (its model and optimizer state were loaded).
    pub fn resumed(&self) -> bool {
        self.starting_epoch > 1 || self.batches > 0 || self.optimizer_steps > 0
    }
}

/// Who is looking for a checkpoint to start from.
pub(crate) struct Resuming<'a> {
    /// This run's id: from the checkpoint directory, only its own checkpoints are taken.
    pub run_id: &'a str,
    /// The key this job signs its checkpoints with (a secret's), if any: this run's own
    /// checkpoints must carry its signature.
    pub key: Option<&'a CheckpointKey>,
    /// The launcher restarted the job (it resumes by itself, and starts afresh with a warning
    /// when there is nothing of the run's to resume).
    pub restarted: bool,
    /// The first rank of this process (rank 0 tells the console).
    pub rank: usize,
    /// The job's ranks.
    pub world_size: usize,
}

/// A checkpoint a run could start from.
#[derive(Debug, Clone)]
enum Candidate {
    /// burn-train's checkpoint of `epoch`, with burn-ddp's state of it when there is one.
    Epoch {
        epoch: usize,
        state: Option<EpochState>,
    },
    /// A step checkpoint.
    Step(StepState),
}

impl Candidate {
    /// Completed epochs and batches of the next one.
    fn progress(&self) -> (usize, usize) {
        match self {
            Candidate::Epoch { epoch, .. } => (*epoch, 0),
            Candidate::Step(state) => (state.epoch.saturating_sub(1), state.batches),
        }
    }

    /// The run that wrote it (`None`: no burn-ddp state says).
    fn owner(&self) -> Option<&str> {
        match self {
            Candidate::Epoch { state, .. } => state.as_ref().map(|s| s.run_id.as_str()),
            Candidate::Step(state) => Some(&state.run_id),
        }
    }

    fn describe(&self, dir: &Path) -> String {
        match self {
            Candidate::Epoch { epoch, .. } => format!(
                "the checkpoint of epoch {epoch} ({})",
                dir.join(format!("model-{epoch}.bpk")).display()
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
            Candidate::Epoch { epoch, .. } => EpochState::path(dir, *epoch),
            Candidate::Step(state) => state.file_in(dir),
        }
    }
}

/// The epochs with a burn-train checkpoint in `dir` (a `model-<epoch>.bpk` file), newest first.
fn epoch_checkpoints(dir: &Path) -> Vec<usize> {
    let mut epochs: Vec<usize> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            name.strip_prefix("model-")?
                .strip_suffix(".bpk")?
                .parse()
                .ok()
        })
        // burn-train counts from 1; the next epoch's number must exist.
        .filter(|epoch: &usize| (1..usize::MAX).contains(epoch))
        .collect();
    epochs.sort_unstable_by(|a, b| b.cmp(a));
    epochs.dedup();
    epochs
}

/// The checkpoints of `dir`, newest first; state files that cannot be read, as messages.
fn candidates_in(dir: &Path) -> (Vec<Candidate>, Vec<String>) {
    let mut found = Vec::new();
    let mut unreadable = Vec::new();
    for state in StepState::list(dir) {
        match state {
            Ok(state) if state.epoch == 0 => unreadable.push(format!(
                "{}: it says epoch 0 (burn-train counts epochs from 1)",
                state.file_in(dir).display()
            )),
            Ok(state) => found.push(Candidate::Step(state)),
            Err(e) => unreadable.push(e.to_string()),
        }
    }
    for epoch in epoch_checkpoints(dir) {
        let path = EpochState::path(dir, epoch);
        let state = match EpochState::read_from(&path) {
            Ok(Some(state)) if state.epoch != epoch => {
                // A state renamed (or copied) to another epoch's name: it says another epoch.
                unreadable.push(format!(
                    "{}: it is the state of epoch {}, not of epoch {epoch}",
                    path.display(),
                    state.epoch
                ));
                continue;
            }
            Ok(state) => state,
            Err(e) => {
                unreadable.push(e.to_string());
                None
            }
        };
        found.push(Candidate::Epoch { epoch, state });
    }
    found.sort_by_key(|c| std::cmp::Reverse(c.progress()));
    (found, unreadable)
}

/// The checkpoints `path` points at: a step state file, an epoch's state file, or a directory
/// (every checkpoint in it).
///
/// # Errors
/// [`DdpError::Checkpoint`] naming `path` when it is none of these or cannot be read.
fn pointed_at(path: &Path) -> Result<(PathBuf, Vec<Candidate>)> {
    let not_one = |detail: String| DdpError::Checkpoint {
        path: path.display().to_string(),
        detail,
    };
    if path.is_dir() {
        let (found, unreadable) = candidates_in(path);
        for why in unreadable {
            warn_console(&format!("not resuming from {why}"));
        }
        return Ok((path.to_path_buf(), found));
    }
    let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name.starts_with("ddp-step-") && name.ends_with(".json") {
        let state = StepState::read_from(path)?
            .ok_or_else(|| not_one("no step checkpoint state there".into()))?;
        if state.epoch == 0 {
            return Err(not_one(
                "it says epoch 0 (burn-train counts epochs from 1)".into(),
            ));
        }
        return Ok((dir, vec![Candidate::Step(state)]));
    }
    let epoch = name
        .strip_prefix("ddp-state-")
        .and_then(|rest| rest.strip_suffix(".json"))
        .and_then(|epoch| epoch.parse::<usize>().ok());
    if let Some(epoch) = epoch {
        let state = EpochState::read_from(path)?
            .ok_or_else(|| not_one("no epoch checkpoint state there".into()))?;
        if state.epoch != epoch || epoch == 0 || epoch == usize::MAX {
            return Err(not_one(format!(
                "it is the state of epoch {}, not of epoch {epoch}",
                state.epoch
            )));
        }
        return Ok((
            dir,
            vec![Candidate::Epoch {
                epoch,
                state: Some(state),
            }],
        ));
    }
    Err(not_one(
        "not a checkpoint: give a directory, a ddp-step-<run tag>-<n>.json or a \
         ddp-state-<epoch>.json"
            .into(),
    ))
}

/// Loads the checkpoint `config` asks to resume from into a copy of `learner`: this run's newest
/// complete one ([`DdpConfig::with_resume`], or a launcher's restart), or the one
/// [`DdpConfig::with_resume_from`] points at; otherwise the run starts where burn-train says
/// (`starting_epoch`, after its own `SupervisedTraining::checkpoint`). `epochs` is burn-train's
/// checkpointer, which reads epoch checkpoints whose state names no records.
///
/// # Errors
/// [`DdpError::Checkpoint`] when resuming was asked for and there is nothing of this run's to
/// resume from (naming another run's newest checkpoint and both run ids, or the empty
/// directory), when a pointed-at checkpoint cannot be found, when the newest usable checkpoint
/// is a step checkpoint of a job with another world size (the batches of a partly trained epoch
/// do not carry over), and when this run would overwrite another run's epoch checkpoints
/// ([`DdpConfig::with_overwrite_checkpoints`]); [`DdpError::InvalidConfig`] for a resume asked
/// for without a checkpoint directory.
pub(crate) fn prepare<M: LearnerModel>(
    config: &DdpConfig,
    learner: &Learner<M>,
    epochs: Option<&LearningCheckpointer<M>>,
    starting_epoch: usize,
    resuming: &Resuming<'_>,
) -> Result<(Option<Learner<M>>, Resume)> {
    // burn-train's own `SupervisedTraining::checkpoint(epoch)` continues whichever run wrote
    // that checkpoint, as the user asked; without burn-train's checkpointer this run writes no
    // epoch files to overwrite another's with.
    let refuse_foreign = || match (epochs, starting_epoch) {
        (Some(_), 0 | 1) => refuse_foreign_epoch_checkpoints(config, resuming),
        _ => Ok(()),
    };
    let asked = config.resume() || config.resume_from().is_some();
    // After burn-train's `checkpoint(k)` (and nothing newer resumed) the run's counters are
    // those of epoch k's state, so step checkpoints keep their numbering.
    let after_burn_trains = || after_epoch(config, starting_epoch, resuming);
    if !asked && !resuming.restarted {
        refuse_foreign()?;
        return Ok((None, after_burn_trains()));
    }
    let (dir, found, own_only) = if let Some(path) = config.resume_from() {
        let (dir, found) = pointed_at(path)?;
        (dir, found, false)
    } else if let Some(dir) = config.checkpoint_dir() {
        let (found, unreadable) = candidates_in(dir);
        for why in unreadable {
            warn_console(&format!("rank {}: not resuming from {why}", resuming.rank));
        }
        (dir.to_path_buf(), found, true)
    } else if asked {
        return Err(DdpError::InvalidConfig(
            "DdpConfig::with_resume needs DdpConfig::with_checkpoint_dir (burn-train's \
             checkpoint directory) or with_resume_from"
                .into(),
        ));
    } else {
        return Ok((None, after_burn_trains()));
    };
    let (mine, theirs): (Vec<Candidate>, Vec<Candidate>) = found
        .into_iter()
        .partition(|c| !own_only || c.owner() == Some(resuming.run_id));
    let loading = Loading {
        key: own_only.then_some(resuming.key).flatten(),
        learner,
        epochs,
        dir: &dir,
        checkpoint_dir: config.checkpoint_dir(),
        resuming,
    };
    let (loaded, skipped) = loading.newest(mine, starting_epoch)?;
    for skip in &skipped {
        warn_console(&format!("rank {}: not resuming from {skip}", resuming.rank));
    }
    let (learner, resume) = match loaded {
        Some((learner, resume)) => (Some(learner), resume),
        None => {
            nothing_to_resume(&dir, &theirs, &skipped, resuming, asked)?;
            (None, after_burn_trains())
        }
    };
    refuse_foreign()?;
    Ok((learner, resume))
}

/// Where a run starts that resumed nothing of burn-ddp's: `starting_epoch` (after burn-train's
/// own `SupervisedTraining::checkpoint(starting_epoch - 1)`), with the counters of that epoch's
/// state in the checkpoint directory when there is one (whichever run wrote it: burn-train's
/// checkpoint is taken as the user asked), else from 0.
fn after_epoch(config: &DdpConfig, starting_epoch: usize, resuming: &Resuming<'_>) -> Resume {
    let mut resume = Resume::from_start(starting_epoch);
    let (Some(dir), Some(finished)) = (config.checkpoint_dir(), starting_epoch.checked_sub(1))
    else {
        return resume;
    };
    if finished == 0 {
        return resume;
    }
    match EpochState::read_from(&EpochState::path(dir, finished)) {
        Ok(Some(state)) if state.epoch == finished => {
            resume.optimizer_steps = state.optimizer_steps;
            resume.synchronisations = state.synchronisations;
        }
        Ok(_) => {}
        Err(e) => warn_console(&format!("rank {}: {e}", resuming.rank)),
    }
    resume
}

/// burn-train writes its epoch checkpoints (`model-<epoch>.bpk`, ...) under names that carry no
/// run: a run that would write them into a checkpoint directory holding another run's (or ones
/// no burn-ddp state file claims) would overwrite them, and its checkpointing strategy delete
/// older ones. Such a run is refused, unless it continues that run
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
            let owner = EpochState::read_from(&EpochState::path(dir, epoch))
                .ok()
                .flatten()
                .map(|s| s.run_id);
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
            warn_console(&format!(
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

/// Loading a candidate checkpoint into a copy of the learner.
struct Loading<'a, M: LearnerModel> {
    /// The job's key when only this run's own checkpoints are taken: they must be signed with
    /// it.
    key: Option<&'a CheckpointKey>,
    learner: &'a Learner<M>,
    /// burn-train's checkpointer (for epoch checkpoints whose state names no records).
    epochs: Option<&'a LearningCheckpointer<M>>,
    /// Where the candidates are.
    dir: &'a Path,
    /// The checkpoint directory, where burn-train's checkpointer reads.
    checkpoint_dir: Option<&'a Path>,
    resuming: &'a Resuming<'a>,
}

/// A learner loaded from a checkpoint, and where its run continues.
type Loaded<M> = (Learner<M>, Resume);

impl<M: LearnerModel> Loading<'_, M> {
    /// The newest of `candidates` past `starting_epoch` that loads, and where the run then
    /// starts; with the reasons the newer ones were passed over.
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] when the newest usable checkpoint is a step checkpoint of a job
    /// with another world size.
    fn newest(
        &self,
        candidates: Vec<Candidate>,
        starting_epoch: usize,
    ) -> Result<(Option<Loaded<M>>, Vec<String>)> {
        let mut skipped = Vec::new();
        for candidate in candidates
            .into_iter()
            .filter(|c| c.progress() > (starting_epoch.saturating_sub(1), 0))
        {
            match self.load(&candidate)? {
                Ok(loaded) => {
                    if self.resuming.rank == 0 {
                        info_console(&format!(
                            "resuming from {} of run {}",
                            candidate.describe(self.dir),
                            candidate.owner().unwrap_or("unknown")
                        ));
                    }
                    let resume = self.resume_after(&candidate);
                    return Ok((Some((loaded, resume)), skipped));
                }
                Err(why) => skipped.push(format!(
                    "{}: it cannot be loaded ({})",
                    candidate.describe(self.dir),
                    // Burn's messages run on with advice about old formats.
                    why.lines().next().unwrap_or_default()
                )),
            }
        }
        Ok((None, skipped))
    }

    /// Where the run continues after `candidate`: a step checkpoint's position and counters, or
    /// the epoch after an epoch checkpoint with its state's counters (an epoch boundary: the
    /// model and optimizer carry over to any world size, and `DistributedSampler` gives the same
    /// global order of samples, which rank 0 tells the console when the world size changed).
    fn resume_after(&self, candidate: &Candidate) -> Resume {
        match candidate {
            Candidate::Step(state) => Resume {
                starting_epoch: state.epoch,
                batches: state.batches,
                optimizer_steps: state.optimizer_steps,
                synchronisations: state.number,
            },
            Candidate::Epoch { epoch, state } => {
                let mut resume = Resume::from_start(epoch.saturating_add(1));
                if let Some(state) = state {
                    resume.optimizer_steps = state.optimizer_steps;
                    resume.synchronisations = state.synchronisations;
                    let world_size = self.resuming.world_size;
                    if state.world_size != world_size && self.resuming.rank == 0 {
                        warn_console(&format!(
                            "resuming after epoch {epoch}, written by a job of world size {}, \
                             with world size {world_size}: the data is re-sharded (with \
                             DistributedSampler every step still sees the same samples if the \
                             global batch is the same, i.e. the per-rank batch times the world \
                             size)",
                            state.world_size
                        ));
                    }
                }
                resume
            }
        }
    }

    /// `candidate` loaded into a copy of the learner (`Err(why)`: it does not load).
    ///
    /// # Errors
    /// [`DdpError::Checkpoint`] for a step checkpoint that loads but was taken mid-epoch by a job
    /// of another world size (only a checkpoint that would be used is refused: a truncated one is
    /// passed over like any other, and one at an epoch's first batch re-shards).
    fn load(&self, candidate: &Candidate) -> Result<std::result::Result<Learner<M>, String>> {
        let loaded = match candidate {
            Candidate::Step(state) => self.read(state),
            Candidate::Epoch {
                state: Some(state), ..
            } if !state.records.is_empty() => self.read(state),
            Candidate::Epoch { epoch, state } => self.through_burn_train(*epoch, state.as_ref()),
        };
        if let (Ok(_), Candidate::Step(state)) = (&loaded, candidate) {
            let world_size = self.resuming.world_size;
            if state.world_size != world_size && state.batches > 0 {
                return Err(DdpError::Checkpoint {
                    path: candidate.state_path(self.dir).display().to_string(),
                    detail: format!(
                        "the newest checkpoint was taken at batch {} of epoch {} by a job of \
                         world size {}, this job has {world_size}: the batches of a partly \
                         trained epoch do not carry over to another world size; resume with {} \
                         ranks, or remove ddp-step-*.json to resume from the last epoch \
                         checkpoint",
                        state.batches, state.epoch, state.world_size, state.world_size
                    ),
                });
            }
        }
        Ok(loaded)
    }

    /// The records `state` names, each checked as it is read, loaded into a copy of the learner.
    fn read(&self, state: &impl SignedState) -> std::result::Result<Learner<M>, String> {
        let records = Records::read(self.dir, state, self.key)?;
        let mut learner = self.learner.clone();
        records.load_into(&mut learner);
        Ok(learner)
    }

    /// An epoch checkpoint whose state names no records (burn-train's own checkpointers), read
    /// through burn-train's checkpointer, in the checkpoint directory only; with the job's key,
    /// its state must be signed with it.
    fn through_burn_train(
        &self,
        epoch: usize,
        state: Option<&EpochState>,
    ) -> std::result::Result<Learner<M>, String> {
        if let Some(key) = self.key {
            match state {
                Some(state) => state.check_signature(Some(key))?,
                None => return Err("no burn-ddp state signed with this job's key names it".into()),
            }
        } else if let Some(state) = state {
            state.check_signature(None)?;
        }
        if self.checkpoint_dir != Some(self.dir) {
            return Err(format!(
                "its state names no record files, which only burn-train's checkpointer reads, in \
                 the checkpoint directory ({})",
                self.checkpoint_dir
                    .map_or("not set".into(), |d| d.display().to_string())
            ));
        }
        let checkpointer = self
            .epochs
            .ok_or_else(|| "burn-train was given no checkpointer to read it with".to_string())?;
        quietly(|| checkpointer.load_checkpoint(self.learner.clone(), epoch))
    }
}

/// Nothing of this run's could be resumed: an error when resuming was asked for, naming
/// another run's newest checkpoint and both run ids (or the empty directory); a warning after a
/// launcher's restart, whose run then starts afresh.
fn nothing_to_resume(
    dir: &Path,
    theirs: &[Candidate],
    skipped: &[String],
    resuming: &Resuming<'_>,
    asked: bool,
) -> Result<()> {
    let newest_other = theirs.first();
    let detail = match newest_other {
        Some(other) => format!(
            "this is run {}, and the newest checkpoint there, {}, belongs to {}: another run's \
             checkpoints are never taken by themselves; resume it with \
             DdpConfig::with_resume_from(<that file or its directory>) (the example: --resume), or \
             continue that run with BURN_DDP_RUN_ID={}",
            resuming.run_id,
            other.describe(dir),
            other.owner().map_or(
                "no run burn-ddp knows of (no burn-ddp state file says)".into(),
                |o| format!("run {o}")
            ),
            other.owner().unwrap_or("<its run id>")
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
        .map(|o| o.state_path(dir))
        .unwrap_or_else(|| dir.to_path_buf());
    if asked {
        return Err(DdpError::Checkpoint {
            path: path.display().to_string(),
            detail: format!("nothing to resume from: {detail}"),
        });
    }
    if resuming.rank == 0 {
        warn_console(&format!(
            "restarted by the launcher, but nothing to resume from in {}: {detail}; training \
             starts from the beginning",
            dir.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{Checkpoints, Ledger, Progress};
    use crate::fixtures::Regressor;
    use burn::module::Module;
    use burn::optim::AdamConfig;
    use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
    use burn::train::checkpoint::Checkpointer;
    use burn_ddp_comm::auth::JobIdentity;
    use std::time::Duration;

    fn learner() -> Learner<Regressor> {
        let device = crate::replica::tests::test_device();
        Learner::new(Regressor::new(&device), AdamConfig::new().init(), 1e-2)
    }

    fn run(dir: &Path, run_id: &str) -> Checkpoints {
        let identity = JobIdentity::new(run_id, Some(b"the team's token")).unwrap();
        Checkpoints::new(dir, &identity, Ledger::default())
    }

    /// Writes `model` with a fresh optimizer's and scheduler's records through `checkpointers`
    /// as checkpoint `number`: the records' files and hashes.
    fn save(
        checkpoints: &Checkpoints,
        checkpointers: &[crate::checkpoint::RecordCheckpointer; 3],
        number: usize,
        model: &Regressor,
    ) -> Vec<crate::checkpoint::RecordFile> {
        let since = checkpoints.ledger().mark();
        let optim = AdamConfig::new().init().to_record();
        let scheduler = ModuleLrScheduler::from(1e-2).to_record();
        checkpointers[0]
            .save(number, model.clone().into_record())
            .unwrap();
        checkpointers[1].save(number, optim).unwrap();
        checkpointers[2].save(number, scheduler).unwrap();
        checkpoints
            .written(checkpointers, number, since, Duration::from_secs(10))
            .unwrap()
    }

    fn progress(
        epoch: usize,
        batches: usize,
        synchronisations: u64,
        world_size: usize,
    ) -> Progress {
        Progress {
            epoch,
            batches,
            world_size,
            optimizer_steps: synchronisations,
            synchronisations,
        }
    }

    /// A model of its own for each checkpoint (and its values, to tell which was loaded).
    fn model() -> (Regressor, Vec<f32>) {
        let model = Regressor::new(&crate::replica::tests::test_device());
        let values = model.values();
        (model, values)
    }

    fn epoch(checkpoints: &Checkpoints, epoch: usize) -> Vec<f32> {
        let (model, values) = model();
        let checkpointers =
            Checkpoints::epoch_checkpointers(checkpoints.dir(), checkpoints.ledger());
        let records = save(checkpoints, &checkpointers, epoch, &model);
        checkpoints
            .write_epoch_state(progress(epoch, 0, 10 * epoch as u64, 2), records)
            .unwrap();
        values
    }

    fn step(
        checkpoints: &Checkpoints,
        epoch: usize,
        batches: usize,
        world_size: usize,
    ) -> Vec<f32> {
        let (model, values) = model();
        let number = 10 * (epoch as u64 - 1) + batches as u64;
        let records = save(
            checkpoints,
            &checkpoints.step_checkpointers(),
            number as usize,
            &model,
        );
        checkpoints
            .write_step_state(progress(epoch, batches, number, world_size), records)
            .unwrap();
        values
    }

    fn resuming<'a>(checkpoints: &'a Checkpoints, world_size: usize) -> Resuming<'a> {
        Resuming {
            run_id: checkpoints.run_id(),
            key: checkpoints.key(),
            restarted: false,
            rank: 1,
            world_size,
        }
    }

    fn resume(config: &DdpConfig, who: &Resuming<'_>) -> Result<(Option<Vec<f32>>, Resume)> {
        prepare(config, &learner(), None, 1, who)
            .map(|(learner, resume)| (learner.map(|l| l.model().values()), resume))
    }

    #[test]
    fn a_run_resumes_its_newest_checkpoint_that_is_what_its_state_says() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let theirs = run(dir.path(), "run-b");
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true)
            .with_overwrite_checkpoints(true);
        let epoch_1 = epoch(&mine, 1);
        let step_2_3 = step(&mine, 2, 3, 2);
        // Another run's newer checkpoint is never taken by itself.
        step(&theirs, 3, 1, 2);
        let (values, at) = resume(&config, &resuming(&mine, 2)).unwrap();
        assert_eq!(values.as_ref(), Some(&step_2_3));
        assert_eq!(
            at,
            Resume {
                starting_epoch: 2,
                batches: 3,
                optimizer_steps: 13,
                synchronisations: 13
            }
        );
        // The step's model file swapped for another one: passed over, epoch 1 is resumed with
        // its counters.
        let swapped = mine.step_checkpointers()[0].path(13);
        std::fs::copy(theirs.step_checkpointers()[0].path(21), &swapped).unwrap();
        let (values, at) = resume(&config, &resuming(&mine, 2)).unwrap();
        assert_eq!(values.as_ref(), Some(&epoch_1));
        assert_eq!(
            at,
            Resume {
                starting_epoch: 2,
                batches: 0,
                optimizer_steps: 10,
                synchronisations: 10
            }
        );
    }

    #[test]
    fn a_stale_epoch_record_under_the_epochs_name_is_not_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true);
        let epoch_1 = epoch(&mine, 1);
        epoch(&mine, 2);
        // An earlier attempt's model of epoch 2 put back under its name.
        std::fs::copy(
            dir.path().join("model-1.bpk"),
            dir.path().join("model-2.bpk"),
        )
        .unwrap();
        let (values, at) = resume(&config, &resuming(&mine, 2)).unwrap();
        assert_eq!(values.as_ref(), Some(&epoch_1));
        assert_eq!(at.starting_epoch, 2);
    }

    #[test]
    fn a_state_not_signed_with_this_jobs_key_is_not_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        // The same run id under another token: its checkpoints are not this job's.
        let impostor = Checkpoints::new(
            dir.path(),
            &JobIdentity::new("run-a", Some(b"another token")).unwrap(),
            Ledger::default(),
        );
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true);
        let step_1_2 = step(&mine, 1, 2, 2);
        step(&impostor, 1, 5, 2);
        let (values, at) = resume(&config, &resuming(&mine, 2)).unwrap();
        assert_eq!(values.as_ref(), Some(&step_1_2));
        assert_eq!(at.batches, 2);
    }

    #[test]
    fn nothing_of_this_run_is_an_error_naming_the_other_run_unless_pointed_at() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let theirs = run(dir.path(), "run-b");
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true);
        let err = resume(&config, &resuming(&mine, 2)).unwrap_err();
        assert!(err.to_string().contains("no complete checkpoint"), "{err}");
        let theirs_values = step(&theirs, 1, 4, 2);
        let err = resume(&config, &resuming(&mine, 2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("run-a") && err.contains("run run-b"), "{err}");
        // A launcher's restart with nothing of its own starts afresh.
        let restarted = Resuming {
            restarted: true,
            ..resuming(&mine, 2)
        };
        let afresh = DdpConfig::default().with_checkpoint_dir(dir.path());
        assert_eq!(
            resume(&afresh, &restarted).unwrap(),
            (None, Resume::from_start(1))
        );
        // Pointed at, another run's checkpoint is taken.
        let pointed = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume_from(theirs.step_state_path(4));
        let (values, at) = resume(&pointed, &resuming(&mine, 2)).unwrap();
        assert_eq!(values.as_ref(), Some(&theirs_values));
        assert_eq!(at.batches, 4);
        // Resuming without a directory to look in is a configuration error.
        let nowhere = DdpConfig::default().with_resume(true);
        assert!(matches!(
            resume(&nowhere, &resuming(&mine, 2)),
            Err(DdpError::InvalidConfig(_))
        ));
        let not_one = DdpConfig::default().with_resume_from(dir.path().join("model-1.bpk"));
        assert!(resume(&not_one, &resuming(&mine, 2)).is_err());
    }

    #[test]
    fn a_step_checkpoint_of_another_world_size_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true);
        step(&mine, 1, 3, 4);
        let err = resume(&config, &resuming(&mine, 2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("world size 4") && err.contains("this job has 2"),
            "{err}"
        );
        // At an epoch boundary the data re-shards: taken.
        let fresh = tempfile::tempdir().unwrap();
        let other = run(fresh.path(), "run-a");
        let at_boundary = epoch(&other, 1);
        let config = DdpConfig::default()
            .with_checkpoint_dir(fresh.path())
            .with_resume(true);
        let (values, at) = resume(&config, &resuming(&other, 3)).unwrap();
        assert_eq!(values.as_ref(), Some(&at_boundary));
        assert_eq!(at.starting_epoch, 2);
    }

    #[test]
    fn an_epoch_written_by_burn_trains_own_checkpointers_is_read_through_them() {
        use burn::train::checkpoint::{AsyncCheckpointer, FileCheckpointer, KeepLastNCheckpoints};
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let [model, optim, scheduler] =
            crate::checkpoint::RECORDS.map(|record| FileCheckpointer::new(dir.path(), record));
        let (written, values) = super::tests::model();
        model.save(1, written.into_record()).unwrap();
        optim.save(1, AdamConfig::new().init().to_record()).unwrap();
        scheduler
            .save(1, ModuleLrScheduler::from(1e-2).to_record())
            .unwrap();
        mine.write_epoch_state(progress(1, 0, 10, 2), Vec::new())
            .unwrap();
        let checkpointer = LearningCheckpointer::new(
            AsyncCheckpointer::new(model),
            AsyncCheckpointer::new(optim),
            AsyncCheckpointer::new(scheduler),
            Box::new(KeepLastNCheckpoints::new(2)),
        );
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true);
        let (loaded, at) = prepare(
            &config,
            &learner(),
            Some(&checkpointer),
            1,
            &resuming(&mine, 2),
        )
        .unwrap();
        assert_eq!(loaded.map(|l| l.model().values()), Some(values));
        assert_eq!(at.optimizer_steps, 10);
        // Without burn-train's checkpointer it cannot be read: nothing of the run loads.
        let err = resume(&config, &resuming(&mine, 2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("none of run run-a's checkpoints"), "{err}");
    }

    /// burn-train's checkpointer of `dir`, as `SupervisedTraining` hands it to the strategy.
    fn burn_trains(dir: &Path) -> LearningCheckpointer<Regressor> {
        use burn::train::checkpoint::{AsyncCheckpointer, KeepLastNCheckpoints};
        let [model, optim, scheduler] = Checkpoints::epoch_checkpointers(dir, &Ledger::default());
        LearningCheckpointer::new(
            AsyncCheckpointer::new(model),
            AsyncCheckpointer::new(optim),
            AsyncCheckpointer::new(scheduler),
            Box::new(KeepLastNCheckpoints::new(2)),
        )
    }

    #[test]
    fn another_runs_epoch_checkpoints_are_not_overwritten_unless_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let theirs = run(dir.path(), "run-b");
        epoch(&theirs, 1);
        let checkpointer = burn_trains(dir.path());
        let with_epochs = |config: &DdpConfig, who: &Resuming<'_>| {
            prepare(config, &learner(), Some(&checkpointer), 1, who).map(|(l, r)| (l.is_some(), r))
        };
        let fresh = DdpConfig::default().with_checkpoint_dir(dir.path());
        let err = with_epochs(&fresh, &resuming(&mine, 2))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run run-b") && err.contains("with_overwrite_checkpoints"),
            "{err}"
        );
        let allowed = fresh.clone().with_overwrite_checkpoints(true);
        assert_eq!(
            with_epochs(&allowed, &resuming(&mine, 2)).unwrap(),
            (false, Resume::from_start(1))
        );
        // Without burn-train's checkpointer this run writes no epoch files: nothing to refuse.
        assert_eq!(
            resume(&fresh, &resuming(&mine, 2)).unwrap(),
            (None, Resume::from_start(1))
        );
        // Its own epoch checkpoints are no reason to refuse.
        let own = tempfile::tempdir().unwrap();
        let again = run(own.path(), "run-a");
        epoch(&again, 1);
        let config = DdpConfig::default().with_checkpoint_dir(own.path());
        let checkpointer = burn_trains(own.path());
        assert!(
            prepare(
                &config,
                &learner(),
                Some(&checkpointer),
                1,
                &resuming(&again, 2)
            )
            .is_ok()
        );
    }

    #[test]
    fn a_state_under_another_epochs_name_is_not_that_epoch() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true);
        let epoch_1 = epoch(&mine, 1);
        epoch(&mine, 2);
        // Epoch 1's state (and records) put under epoch 2's names.
        for name in ["ddp-state", "model", "optim", "scheduler"] {
            let ext = if name == "ddp-state" { "json" } else { "bpk" };
            std::fs::copy(
                dir.path().join(format!("{name}-1.{ext}")),
                dir.path().join(format!("{name}-2.{ext}")),
            )
            .unwrap();
        }
        let (values, at) = resume(&config, &resuming(&mine, 2)).unwrap();
        assert_eq!(values.as_ref(), Some(&epoch_1));
        assert_eq!(at.starting_epoch, 2, "resumed as epoch 1, not as epoch 2");
        let pointed = DdpConfig::default().with_resume_from(EpochState::path(dir.path(), 2));
        let err = resume(&pointed, &resuming(&mine, 2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not of epoch 2"), "{err}");
    }

    #[test]
    fn a_step_state_of_epoch_0_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        let config = DdpConfig::default()
            .with_checkpoint_dir(dir.path())
            .with_resume(true);
        let step_1_2 = step(&mine, 1, 2, 2);
        let mut zero = StepState::read_from(&mine.step_state_path(2))
            .unwrap()
            .unwrap();
        zero.epoch = 0;
        zero.number = 50;
        zero.write_to(&mine.step_state_path(50)).unwrap();
        let (values, at) = resume(&config, &resuming(&mine, 2)).unwrap();
        assert_eq!(values.as_ref(), Some(&step_1_2));
        assert_eq!(at.starting_epoch, 1);
        let pointed = DdpConfig::default().with_resume_from(mine.step_state_path(50));
        let err = resume(&pointed, &resuming(&mine, 2))
            .unwrap_err()
            .to_string();
        assert!(err.contains("epoch 0"), "{err}");
    }

    #[test]
    fn after_burn_trains_own_checkpoint_the_counters_are_its_epochs() {
        let dir = tempfile::tempdir().unwrap();
        let mine = run(dir.path(), "run-a");
        epoch(&mine, 1);
        let config = DdpConfig::default().with_checkpoint_dir(dir.path());
        // `SupervisedTraining::checkpoint(1)`: burn-train loaded epoch 1, the run starts at 2.
        let (loaded, at) = prepare(&config, &learner(), None, 2, &resuming(&mine, 2)).unwrap();
        assert!(loaded.is_none());
        assert_eq!(
            at,
            Resume {
                starting_epoch: 2,
                batches: 0,
                optimizer_steps: 10,
                synchronisations: 10
            }
        );
    }
}
