//! A step's batch: the next one from the loader (and, in join mode, what the ranks agreed on
//! before it), then its forward and backward passes.

use std::time::Instant;

use burn::data::dataloader::DataLoaderIterator;
use burn::optim::GradientsParams;
use burn::train::LearnerModel;

use super::super::rank::{ModelOutput, ValidOutput};
use super::{
    Batch, EpochState, Input, Run, Stop, Trainer, TrainingModelInput, without_sample_under_sync_bn,
};
use crate::error::{DdpError, Result};
use crate::metrics::RankReport;

impl<M: LearnerModel + Send + 'static> Trainer<M>
where
    ModelOutput<M>: 'static,
    ValidOutput<M>: 'static,
{
    /// The next batch and what the ranks agreed on before it (join mode); `None` when the
    /// epoch's steps end here (nobody has a batch, or a stop agreed in join mode).
    pub(super) fn next_batch(
        &mut self,
        state: &mut EpochState<M>,
        iterator: &mut dyn DataLoaderIterator<TrainingModelInput<M>>,
        run: &Run,
        report: &mut RankReport,
    ) -> Result<Option<(Batch<M>, Input<M>)>> {
        let before = iterator.progress().items_processed;
        // Burn 0.22's loaders yield `Result`: a batch that cannot be read ends the run, as it
        // ends one device's (burn-train fails its interrupter), with the batch's position.
        let input = match iterator.next() {
            Some(Ok(input)) => Some(input),
            Some(Err(err)) => {
                return Err(DdpError::WorkerPanicked {
                    rank: self.rank,
                    message: format!(
                        "batch {} of epoch {} cannot be read from the training loader: {err}",
                        state.step + 1,
                        state.epoch
                    ),
                });
            }
            None => None,
        };
        // A DistributedDataLoader (or a loader dealt as one device reads it) says what the step
        // holds over all ranks: this rank's share of it weighs its gradients, and a rank whose
        // shard ended a batch early (the epoch's last step has fewer samples, or batches, than
        // ranks) takes part in that step without a sample.
        let distributed = self.loaders.train_loader != 0;
        let drawn = (self.cut.draws_steps(distributed) && !run.policy.join())
            .then(crate::sampler::drawn_on_this_thread)
            .flatten();
        // The batch's samples: as drawn, else the loader's progress over it (a dealt loader's
        // progress is this rank's share of one device's, not its own count).
        let samples = match (&input, drawn) {
            (None, _) => 0,
            (Some(_), Some(drawn)) if drawn.samples > 0 => drawn.samples as usize,
            (Some(_), _) => iterator
                .progress()
                .items_processed
                .saturating_sub(before)
                .max(1),
        };
        state.local_samples += samples as u64;
        let without_sample =
            input.is_none() && drawn.is_some_and(|d| (state.step as u64) < d.steps);
        if without_sample {
            crate::sampler::Drawn::enter_step_without_sample();
        }
        let drawn = drawn.and(crate::sampler::drawn_on_this_thread());
        // A loader dealt as one device reads it learns only at the epoch's last step that a
        // rank has no batch in it: every rank finds it here, before a forward pass whose
        // SyncBatchNorm collectives the rank without a batch would not join.
        if let Some(drawn) = &drawn
            && drawn.leaves_a_rank_without_samples()
            && crate::sync_bn::used_on_this_thread()
        {
            return Err(without_sample_under_sync_bn(drawn));
        }
        // Join mode: every step starts with an agreement on who still has a batch (the weights
        // of the reduction depend on it). Otherwise every rank has a batch until all run out
        // together, and the stop votes ride in the gradient all-reduce: one collective per step.
        // A rank out of data takes part in one more reduction, without gradients and saying so:
        // every rank issues the same collectives (even NCCL, which cannot tell calls apart,
        // learns of uneven data), unless the others are inside an accumulation window or
        // SyncBatchNorm's forward pass, where the reduction meets another collective (Mismatch
        // on the CPU groups).
        let agreement = if run.policy.join() {
            let started = Instant::now();
            let agreement = self.agree(samples)?;
            report.coordination += started.elapsed();
            if agreement.interrupted {
                state.stop = Some(Stop::Interrupted);
                return Ok(None);
            }
            // A stop signal is taken at an optimizer step's boundary, on every rank alike.
            if !agreement.signalled.is_empty() && run.policy.at_step_boundary() {
                state.stop = Some(Stop::Signal(agreement.signalled));
                return Ok(None);
            }
            if agreement.samples.iter().all(|&s| s == 0) {
                return Ok(None);
            }
            Some(agreement)
        } else {
            None
        };
        let batch = Batch {
            samples,
            drawn,
            out_of_data: !run.policy.join() && input.is_none() && !without_sample,
            agreement,
            item: None,
        };
        Ok(Some((batch, input)))
    }

    /// The batch's forward and backward passes: its gradients
    /// (`None` without a batch); the output goes to `batch.item`.
    pub(super) fn forward(
        &mut self,
        input: Option<TrainingModelInput<M>>,
        batch: &mut Batch<M>,
        run: &Run,
        report: &mut RankReport,
    ) -> Result<Option<GradientsParams>> {
        // The learning rate steps at the optimizer step (`apply`), as in burn-train 0.22's loop.
        let output = input
            .map(|input| {
                let started = Instant::now();
                let output = self.learner.train_step(input);
                // On an asynchronous runtime (CUDA, wgpu) the passes' kernels run behind this
                // thread: their time is compute, not the bucket copies that would wait for them,
                // and what the step produced (its output, its gradients, BatchNorm's statistics)
                // is complete before any of it reaches another replica's thread.
                crate::replica::sync_device(
                    self.rank,
                    &self.device,
                    "the step's forward and backward passes",
                )?;
                report.compute += started.elapsed();
                report.batches += 1;
                Ok::<_, DdpError>(output)
            })
            .transpose()?;
        if run.policy.join() && crate::sync_bn::used_on_this_thread() {
            return Err(DdpError::InvalidConfig(
                "SyncBatchNorm cannot be combined with UnevenInputs::Join: a rank without a \
                 batch skips its forward pass and its SyncBatchNorm collectives"
                    .into(),
            ));
        }
        // Found after the first forward pass on every rank alike, not at the epoch's end.
        if let Some(drawn) = batch.drawn
            && drawn.leaves_a_rank_without_samples()
            && crate::sync_bn::used_on_this_thread()
        {
            return Err(without_sample_under_sync_bn(&drawn));
        }
        Ok(match output {
            Some(output) => {
                batch.item = Some(output.item);
                Some(output.grads)
            }
            // Join mode: this rank ran out of batches and contributes zeros.
            None => None,
        })
    }
}
