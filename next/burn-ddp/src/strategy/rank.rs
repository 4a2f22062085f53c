//! What every part of a rank's training shares: the output types, the messages between ranks
//! that are threads of one process, where a rank's items go (its [`Role`]: rank 0 holds
//! burn-train's components), and the rank as the parts see it ([`Comm`]).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use burn::tensor::Device;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, EventProcessorTraining, InferenceStep, Interrupter, LearnerModel,
    LearningCheckpointer, SupervisedTrainingEventProcessor, TrainStep, ValidLoader,
};

use super::handoff::Handoff;
use super::metrics_file::MetricsFile;
use crate::checkpoint::{Checkpoints, StepCheckpointer};
use burn_ddp_comm::group::ProcessGroup;

/// The input of a validation step.
pub(super) type ValidInput<M> = <M as InferenceStep>::Input;
/// The output of a validation step.
pub(super) type ValidOutput<M> = <M as InferenceStep>::Output;
/// The output of a training step.
pub(super) type ModelOutput<M> = <M as TrainStep>::Output;

/// A rank's output of one step, sent to rank 0 by a rank that is a thread of the same process.
pub(super) enum Part<M: LearnerModel> {
    /// Training step `step` of the epoch; `None`: the rank had no batch (join mode).
    Train {
        rank: usize,
        step: usize,
        output: Option<Handoff<ModelOutput<M>>>,
    },
    /// Batch `index` of one device's validation pass (a rank's is `index % world_size`), with
    /// one device's progress after it.
    Valid {
        index: usize,
        progress: burn::data::dataloader::Progress,
        output: Handoff<ValidOutput<M>>,
    },
    /// `rank` validated its share of the pass.
    ValidDone { rank: usize },
}

/// What rank 0 holds besides its replica: burn-train's components and the other ranks' items.
pub(super) struct Leader<M: LearnerModel> {
    pub event_processor: SupervisedTrainingEventProcessor<M>,
    /// burn-train's interrupter: an event burn-train's processor cannot handle stops training
    /// through it, as burn-train's own loop does (`fail_on_error`).
    pub interrupter: Interrupter,
    /// Rank 0's one copy of the validation loader, when it validates alone (`None`: validation
    /// is sharded, and read through the ranks' [`ValidShard`](super::validation::ValidShard)).
    pub dataloader_valid: Option<ValidLoader<M>>,
    /// burn-train's checkpointer of epoch checkpoints.
    pub checkpointer: Option<LearningCheckpointer<M>>,
    /// The run's checkpoints and burn-ddp's step checkpoints (with a checkpoint directory).
    pub checkpoints: Option<(Checkpoints, StepCheckpointer<M>)>,
    pub early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    pub event_store: Arc<EventStoreClient>,
    /// The outputs of the ranks that are threads of this process.
    pub items: Receiver<Part<M>>,
    /// [`DdpConfig::with_metrics_file`](crate::DdpConfig::with_metrics_file)'s file.
    pub metrics_file: Option<MetricsFile>,
}

impl<M: LearnerModel> Leader<M> {
    /// Returns once burn-train's event processor has handled every event sent to it so far (so
    /// the event store holds the epoch's metrics that early stopping and the checkpointing
    /// strategy ask for): burn-train 0.22's `flush`, as its own loop calls it before the
    /// checkpoint. A metric that failed on an event since the last call fails the interrupter.
    pub fn wait_for_events(&mut self) {
        self.interrupter.fail_on_error(self.event_processor.flush());
    }

    /// Hands burn-train a training event; a metric that cannot process it fails the
    /// interrupter, as in burn-train's own loop.
    pub fn train_event(&mut self, event: burn::train::LearnerEvent<ModelOutput<M>>) {
        self.interrupter
            .fail_on_error(self.event_processor.process_train(event));
    }

    /// Hands burn-train a validation event (see [`train_event`](Self::train_event)).
    pub fn valid_event(&mut self, event: burn::train::LearnerEvent<ValidOutput<M>>) {
        self.interrupter
            .fail_on_error(self.event_processor.process_valid(event));
    }
}

/// Where a rank's training items go.
pub(super) enum Role<M: LearnerModel> {
    /// Global rank 0.
    Leader(Box<Leader<M>>),
    /// Another rank in the same process: its items go to rank 0.
    Follower(Sender<Part<M>>),
    /// Another rank in its own process: emits nothing, but hands this process's event processor
    /// back to burn-train.
    Silent(Box<SupervisedTrainingEventProcessor<M>>),
}

/// This rank as the parts of its training see it: its number, its process group, its device and
/// the collectives' timeout.
pub(super) struct Comm<'a> {
    pub rank: usize,
    pub group: &'a Arc<dyn ProcessGroup>,
    pub device: &'a Device,
    pub timeout: Duration,
}
