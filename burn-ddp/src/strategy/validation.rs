//! Validation at the end of an epoch: rank 0 runs burn-train's validation loop over the whole
//! validation set, as the single-device strategy does, while the other ranks wait at the
//! end-of-epoch collective.

use burn::data::dataloader::Progress;
use burn::module::AutodiffModule;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent,
    LearningComponentsTypes, TrainingItem,
};

use super::worker::Leader;

/// Rank 0's validation pass over the whole validation set, as burn-train's single-device loop.
pub(super) fn validate<LC: LearningComponentsTypes>(
    learner: &Learner<LC>,
    leader: &mut Leader<LC>,
    progress_global: &Progress,
    interrupter: &Interrupter,
) {
    let epoch = progress_global.items_processed;
    let model = learner.model().valid();
    let mut iterator = leader.dataloader_valid.iter();
    let mut iteration = 0;
    while let Some(item) = iterator.next() {
        iteration += 1;
        let progress = iterator.progress();
        let output = InferenceStep::step(&model, item);
        let item = TrainingItem::new(
            output,
            progress,
            progress_global.clone(),
            Some(iteration),
            None,
        );
        leader
            .event_processor
            .process_valid(LearnerEvent::ProcessedItem(item));
        if interrupter.should_stop() {
            break;
        }
    }
    leader
        .event_processor
        .process_valid(LearnerEvent::EndEpoch(epoch));
}
