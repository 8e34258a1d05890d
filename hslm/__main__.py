from . import main_or_missing_package

main_or_missing_package()()
