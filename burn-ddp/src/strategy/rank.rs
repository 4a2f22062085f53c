//! What every part of a rank's training shares: the output types, the messages between ranks
//! that are threads of one process, where a rank's items go (its [`Role`]: rank 0 holds
//! burn-train's components), and the rank as the parts see it ([`Comm`]).

use super::handoff::Handoff;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use burn::tensor::Device;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::store::EventStoreClient;
use burn::train::{
    CloneEarlyStoppingStrategy, InferenceStep, LearningCheckpointer, LearningComponentsTypes,
    SupervisedTrainingEventProcessor, TrainStep, TrainingBackend, TrainingModel, ValidLoader,
};

use super::metrics_file::MetricsFile;
use super::step_checkpoints::StepCheckpoints;
use burn_ddp_comm::group::ProcessGroup;

/// The backend of validation (the training backend without autodiff).
pub(super) type InnerBackend<LC> = <TrainingBackend<LC> as AutodiffBackend>::InnerBackend;
/// The input of a validation step.
pub(super) type ValidInput<LC> =
    <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Input;
/// The output of a validation step.
pub(super) type ValidOutput<LC> =
    <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;

/// A rank's output of one step, sent to rank 0 by a rank that is a thread of the same process.
pub(super) enum Part<LC: LearningComponentsTypes> {
    /// Training step `step` of the epoch; `None`: the rank had no batch (join mode).
    Train {
        rank: usize,
        step: usize,
        output: Option<Handoff<ModelOutput<LC>>>,
    },
    /// Batch `index` of one device's validation pass (a rank's is `index % world_size`), with
    /// one device's progress after it.
    Valid {
        index: usize,
        progress: burn::data::dataloader::Progress,
        output: Handoff<ValidOutput<LC>>,
    },
    /// `rank` validated its share of the pass.
    ValidDone { rank: usize },
}

pub(super) type ModelOutput<LC> = <TrainingModel<LC> as TrainStep>::Output;

/// What rank 0 holds besides its replica: burn-train's components and the other ranks' items.
pub(super) struct Leader<LC: LearningComponentsTypes> {
    pub event_processor: SupervisedTrainingEventProcessor<LC>,
    /// Rank 0's one copy of the validation loader, when it validates alone (`None`: validation
    /// is sharded, and read through the ranks' [`ValidShard`](super::validation::ValidShard)).
    pub dataloader_valid: Option<ValidLoader<LC>>,
    pub checkpointer: Option<LearningCheckpointer<LC>>,
    /// burn-ddp's step checkpoints (with a checkpoint directory).
    pub step_checkpoints: Option<StepCheckpoints<LC>>,
    pub early_stopping: Option<Box<dyn CloneEarlyStoppingStrategy>>,
    pub event_store: Arc<EventStoreClient>,
    /// The outputs of the ranks that are threads of this process.
    pub items: Receiver<Part<LC>>,
    /// [`DdpConfig::with_metrics_file`](crate::DdpConfig::with_metrics_file)'s file.
    pub metrics_file: Option<MetricsFile>,
}

impl<LC: LearningComponentsTypes> Leader<LC> {
    /// Returns once burn-train's event processor has handled every event sent to it so far (so
    /// the event store holds the epoch's metrics that early stopping and the checkpointing
    /// strategy ask for). The processor runs on its own thread behind a channel of capacity one,
    /// and handles a validation `Start` as a no-op: once the second of two `Start`s is accepted,
    /// the first was taken, so every event before it was handled. Bounded as any event burn-train
    /// sends itself: by the time the renderer and metric loggers take for the events before.
    pub fn wait_for_events(&mut self) {
        use burn::train::{EventProcessorTraining, LearnerEvent};
        self.event_processor.process_valid(LearnerEvent::Start);
        self.event_processor.process_valid(LearnerEvent::Start);
    }
}

/// Where a rank's training items go.
pub(super) enum Role<LC: LearningComponentsTypes> {
    /// Global rank 0.
    Leader(Box<Leader<LC>>),
    /// Another rank in the same process: its items go to rank 0.
    Follower(Sender<Part<LC>>),
    /// Another rank in its own process: emits nothing, but hands this process's event processor
    /// back to burn-train.
    Silent(Box<SupervisedTrainingEventProcessor<LC>>),
}

/// This rank as the parts of its training see it: its number, its process group, its device and
/// the collectives' timeout.
pub(super) struct Comm<'a, LC: LearningComponentsTypes> {
    pub rank: usize,
    pub group: &'a Arc<dyn ProcessGroup>,
    pub device: &'a Device<TrainingBackend<LC>>,
    pub timeout: Duration,
}
