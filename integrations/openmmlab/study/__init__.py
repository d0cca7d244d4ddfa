"""Studies that compare Φp with one budget per row: what a study is (:mod:`.spec`), its checks
before anything trains (:mod:`.checks`), its runs and their records (:mod:`.runs`,
:mod:`.records`), the step timing (:mod:`.timing`), and its tables, figures and files
(:mod:`.report`, :mod:`.figures`, :mod:`.outputs`). ``tools/compare_phis.py`` is the command."""
from .checks import StudyError, checked_run_configs
from .outputs import write_outputs
from .records import RunRecord, RunStore
from .runs import RunFailed, StudyRunner, collect_runs, run_options
from .spec import STUDIES, Study, load_data, load_study, planned_rows, study_of_configs
from .timing import WARMUP_STEPS, time_training_steps

__all__ = ['StudyError', 'checked_run_configs', 'write_outputs', 'RunRecord', 'RunStore', 'RunFailed',
           'StudyRunner', 'collect_runs', 'run_options', 'STUDIES', 'Study', 'load_data', 'load_study',
           'planned_rows', 'study_of_configs', 'WARMUP_STEPS', 'time_training_steps']
